"""`ingot` command line: serve | generate | chat | bench | compile | convert | validate.

Engine flags use vLLM's names. Errors a user can cause print one ``error:`` line, no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ingot.engine.arg_utils import (
    EngineArgs,
    add_dataclass_args,
    add_engine_args,
    engine_args_from,
    size_one_shot,
)
from ingot.errors import IngotError
from ingot.sampling_params import SamplingParams
from ingot.version import __version__

logger = logging.getLogger("ingot")


def _nullable_int(value: str) -> int | None:
    return None if value.lower() in ("none", "null") else int(value)


# ---- one-shot sizing (engine/arg_utils.py) ----------------------------------------------
# The workload of `chat` and of a one-shot prompt, which these commands size the engine for.
CHAT_TOKEN_BUDGET = 256  # interactive turns: prefix caching leaves only the new turn to prefill
# Room for a chat template's framing and special tokens around the messages.
TEMPLATE_SLACK_TOKENS = 64


def given_flags(argv: Sequence[str] | None) -> set[str]:
    """The option dests the command line set explicitly (not parser or subcommand defaults),
    found by parsing it again with every default suppressed."""
    parser = build_parser()

    def suppress(p: argparse.ArgumentParser) -> None:
        p._defaults.clear()  # set_defaults(...), e.g. bench's peer settings
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    suppress(sub)
            elif action.dest != "help":
                action.default = argparse.SUPPRESS

    suppress(parser)
    return set(vars(parser.parse_args(argv)))


def prompt_token_bound(*texts: str | None, templated: bool = False) -> int:
    """An upper bound on the prompt's tokens before the tokenizer is loaded: byte-level BPE
    tokenizers give at most one token per UTF-8 byte (a longer prompt is still correct, its
    prefill is only split into chunks)."""
    n = sum(len(t.encode("utf-8")) for t in texts if t) + 8
    return n + TEMPLATE_SLACK_TOKENS if templated else n


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=_nullable_int, default=None, dest="sampling_seed",
                   help="per-request sampling seed")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=ns.n,
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        presence_penalty=ns.presence_penalty,
        frequency_penalty=ns.frequency_penalty,
        seed=ns.sampling_seed,
        stop=ns.stop,
        ignore_eos=ns.ignore_eos,
    )


def cmd_generate(ns: argparse.Namespace) -> int:
    from ingot.entrypoints.llm import LLM

    params = sampling_params_from(ns)  # validate before loading the model
    size_one_shot(ns, ns.n, prompt_token_bound(ns.prompt, ns.system, templated=ns.chat))
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    if ns.chat:
        messages: list[dict[str, Any]] = []
        if ns.system:
            messages.append({"role": "system", "content": ns.system})
        messages.append({"role": "user", "content": ns.prompt})
        outputs = llm.chat(messages, params)
    else:
        outputs = llm.generate(ns.prompt, params)
    for completion in outputs[0].outputs:
        print(completion.text)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from ingot.entrypoints.llm import LLM

    params = sampling_params_from(ns)
    size_one_shot(ns, ns.n, CHAT_TOKEN_BUDGET)
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    messages: list[dict[str, Any]] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print("ingot chat: type a message, /reset to start over, /exit or Ctrl-D to quit.")
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = messages[:1] if ns.system else []
            continue
        messages.append({"role": "user", "content": text})
        reply = llm.chat(messages, params)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})


def cmd_convert(ns: argparse.Namespace) -> int:
    from ingot.config import parse_dtype
    from ingot.model_executor.loader.gguf_loader import convert_gguf_to_hf

    dtype = parse_dtype(ns.dtype)
    out = convert_gguf_to_hf(ns.gguf, ns.out_dir, dtype=dtype) if dtype else convert_gguf_to_hf(
        ns.gguf, ns.out_dir
    )
    print(f"wrote {out}")
    return 0


def _check_listen(host: str, port: int) -> None:
    """Fail before the model loads (seconds) if the address cannot be served."""
    import socket

    if not 0 < port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} does not resolve ({exc}); use e.g. 127.0.0.1") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Same option uvicorn sets, so a port in TIME_WAIT from a previous run is not refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            raise ValueError(
                f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or stop "
                "the process using it"
            ) from None


def cmd_serve(ns: argparse.Namespace) -> int:
    import os

    from ingot.entrypoints.openai.api_server import serve
    from ingot.entrypoints.openai.limits import ServerLimits

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError("give the model either as the positional MODEL or as --model, not both")
        ns.model = ns.model_tag
    if ns.headless:
        return _serve_headless(ns)
    if ns.max_request_body_bytes <= 0:
        raise ValueError(
            f"--max-request-body-bytes must be positive, got {ns.max_request_body_bytes}"
        )
    api_key = ns.api_key if ns.api_key is not None else os.environ.get("INGOT_API_KEY")
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key (or INGOT_API_KEY) is empty; give a key or leave it unset")
    _check_listen(ns.host, ns.port)
    chat_options = chat_options_from(ns)  # bad parser names / files fail before the model loads
    limits = ServerLimits.from_namespace(ns)
    args = engine_args_from(ns)
    return serve(
        args,
        ns.host,
        ns.port,
        {"api_key": api_key, "max_body_bytes": ns.max_request_body_bytes,
         "chat_options": chat_options, "limits": limits, **_server_log_settings(ns, api_key)},
        metrics_name_prefix=ns.metrics_name_prefix,
    )


def check_headless(args: EngineArgs) -> str:
    """What ``serve --headless`` runs here: "workers" (a TP node other than node 0) or
    "replicas" (data-parallel replicas of a node other than the API server's)."""
    if args.nnodes > 1:
        if args.node_rank < 1:
            raise ValueError(
                "--headless with --nnodes runs a node other than node 0 (which runs the engine "
                "and the API server, without --headless): give --node-rank R (>= 1)"
            )
        return "workers"
    if args.data_parallel_size < 2 or args.data_parallel_start_rank < 1:
        raise ValueError(
            "--headless runs the ranks of a node other than the API server's: give "
            "--nnodes N --node-rank R (>= 1) with --master-addr (TP across nodes), or "
            "--data-parallel-size N (> 1) and --data-parallel-start-rank R (>= 1, the first "
            "replica here), with --data-parallel-address and --data-parallel-rpc-port of the "
            "API server's node"
        )
    return "replicas"


def _serve_headless(ns: argparse.Namespace) -> int:
    """``serve --headless``: this node's worker ranks or data-parallel replicas, no API
    server."""
    args = engine_args_from(ns)
    what = check_headless(args)
    config = args.create_engine_config()
    if what == "workers":
        from ingot.worker.multiproc_executor import run_headless_workers

        return run_headless_workers(config)
    from ingot.engine.dp_client import run_headless

    return run_headless(config)


def chat_options_from(ns: argparse.Namespace) -> Any:
    """--chat-template, --enable-auto-tool-choice, --tool-call-parser, --tool-parser-plugin and
    --reasoning-parser, checked and resolved (vLLM's rules and names)."""
    from ingot.entrypoints.openai.reasoning_parsers import get_reasoning_parser
    from ingot.entrypoints.openai.serving import ChatOptions
    from ingot.entrypoints.openai.tool_parsers import get_tool_parser, load_tool_parser_plugin

    if ns.tool_parser_plugin:
        load_tool_parser_plugin(ns.tool_parser_plugin)
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (e.g. hermes)")
    template = None
    if ns.chat_template is not None:
        path = Path(ns.chat_template)
        # vLLM's rule: a path to a file, or else the template text itself.
        if path.is_file():
            template = path.read_text()
        elif "{" in ns.chat_template:
            template = ns.chat_template
        else:
            raise ValueError(f"--chat-template {ns.chat_template!r} is not a file")
    return ChatOptions(
        chat_template=template,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_parser=get_tool_parser(ns.tool_call_parser) if ns.tool_call_parser else None,
        reasoning_parser=get_reasoning_parser(ns.reasoning_parser) if ns.reasoning_parser else None,
    )


def _server_log_settings(ns: argparse.Namespace, api_key: str | None) -> dict[str, Any]:
    if ns.api_key_protect_metrics and not api_key:
        raise ValueError("--api-key-protect-metrics needs an API key (--api-key or INGOT_API_KEY)")
    if ns.enable_log_requests and ns.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict; drop one")
    return {"api_key_protect_metrics": ns.api_key_protect_metrics,
            "access_log": not ns.disable_uvicorn_access_log,
            "log_requests": ns.enable_log_requests}


def cmd_compile(ns: argparse.Namespace) -> int:
    """Compile every bucket of the grid into the cache, without serving."""
    from ingot.engine.core import EngineCore

    if ns.enforce_eager:
        raise ValueError("ingot compile compiles the bucket grid; --enforce-eager would skip "
                         "exactly that, drop it")
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise ValueError("give the model either as the positional MODEL or as --model, not both")
        ns.model = ns.model_tag
    ns.compile = True
    config = engine_args_from(ns).create_engine_config()
    config.compilation.hit_only = False  # filling the cache is the point, whatever the env says
    core = EngineCore(config)
    try:
        print(core.collective_rpc("compile_summary")[0])
    finally:
        core.shutdown()
    return 0


def cmd_bench(ns: argparse.Namespace) -> int:
    from ingot.benchmarks.workloads import WORKLOADS, parse_batch_sizes, run_workloads

    if ns.workload == "serve":  # a client of a running server: no engine in this process
        from ingot.benchmarks.contend import contention
        from ingot.benchmarks.serve import run_serve_bench

        with contention(ns.contend):
            run_serve_bench(ns.base_url, ns.concurrency, ns.num_requests, ns.input_len,
                            ns.output_len, ns.model, ns.engine_label, vocab_size=ns.vocab_size,
                            endpoint=ns.endpoint)
        return 0
    names = ns.workload.split(",") if ns.workload != "all" else ["offline", "single", "prefill"]
    if names and all(WORKLOADS.get(n, (2,))[0] == 1 for n in names):
        # One request at a time: the grid of a 64-sequence run would only add warmup. The same
        # buckets run (a prompt fits the budget whole, as with the default 2048).
        size_one_shot(ns, 1, max(WORKLOADS[n][1] for n in names))
    run_workloads(engine_args_from(ns), names, progress=not ns.no_progress,
                  batch_sizes=parse_batch_sizes(ns.batch_sizes),
                  sweep_output_len=ns.sweep_output_len, contend=ns.contend)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ingot", description="ingot LLM inference engine")
    parser.add_argument("--version", action="version", version=f"ingot {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="model path (same as --model)")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default: %(default)s; 0.0.0.0 for all)")
    srv.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    srv.add_argument("--api-key", default=None,
                     help="require this key as 'Authorization: Bearer KEY' on every route but "
                     "/health, /version and /metrics "
                     "(default: $INGOT_API_KEY if set, else no key)")
    srv.add_argument("--headless", action="store_true",
                     help="no API server: run this node's worker ranks (--nnodes, --node-rank) "
                     "for node 0 at --master-addr, or its data-parallel replicas "
                     "(--data-parallel-start-rank, --data-parallel-size-local) for the server "
                     "at --data-parallel-address")
    srv.add_argument("--max-request-body-bytes", type=int, default=8 * 2**20,
                     help="larger request bodies get 413 (default: %(default)s)")
    # Server logging, metrics naming and key scope (docs/serving.md); vLLM's flag names.
    srv.add_argument("--api-key-protect-metrics", action="store_true",
                     help="also require the API key on /metrics")
    srv.add_argument("--metrics-name-prefix", default="ingot", choices=["ingot", "vllm"],
                     help="vllm: expose metrics that have a vLLM counterpart under vLLM's names "
                     "(vllm:...) for vLLM dashboards (default: %(default)s)")
    srv.add_argument("--enable-log-requests", action="store_true",
                     help="log each generation request's prompt length and sampling parameters")
    srv.add_argument("--disable-log-requests", action="store_true",
                     help="do not log requests' parameters (the default; vLLM's older flag)")
    tools = srv.add_argument_group("chat: templates, tools, reasoning (docs/serving.md)")
    tools.add_argument("--chat-template", default=None, metavar="FILE",
                       help="Jinja chat template file used instead of the model's")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto": parse tool calls from free text')
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="hermes | llama3_json | pythonic | a plugin's name")
    tools.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                       help="Python file registering tool parsers (@register_tool_parser)")
    tools.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="deepseek_r1 | qwen3: <think> text goes to message.reasoning")
    srv.add_argument("--disable-uvicorn-access-log", action="store_true",
                     help="no access-log line per HTTP request")
    from ingot.entrypoints.openai.limits import ServerLimits

    add_dataclass_args(srv, ServerLimits)
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="complete one prompt and print the result")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=256)

    bench = sub.add_parser(
        "bench", help="run the shared benchmark workloads (offline, single, prefill, sweep), "
        "or load a running server (serve)"
    )
    bench.add_argument("workload", help="offline | single | prefill | sweep | a comma list | "
                       "all | serve")
    bench.add_argument("--no-progress", action="store_true")
    bench.add_argument("--contend", type=int, default=0, metavar="N",
                       help="run N CPU-bound competing processes during the workloads "
                       "(default: %(default)s)")
    from ingot.benchmarks.workloads import SWEEP_OUTPUT_LEN

    sw = bench.add_argument_group("sweep")
    sw.add_argument("--batch-sizes", default="1,4,16,64",
                    help="batch sizes of the sweep workload (default: %(default)s)")
    sw.add_argument("--sweep-output-len", type=int, default=SWEEP_OUTPUT_LEN,
                    help="new tokens per request in the sweep (default: %(default)s)")
    sv = bench.add_argument_group("serve (client of a running server; --model is the "
                                  "served model name, default: the server's first)")
    sv.add_argument("--base-url", default="http://127.0.0.1:8000")
    sv.add_argument("--concurrency", type=int, default=4, help="(default: %(default)s)")
    sv.add_argument("--num-requests", type=int, default=16, help="(default: %(default)s)")
    sv.add_argument("--input-len", type=int, default=128, help="(default: %(default)s)")
    sv.add_argument("--output-len", type=int, default=128, help="(default: %(default)s)")
    sv.add_argument("--engine-label", default="ingot",
                    help="engine= field of the RESULT line (default: %(default)s)")
    sv.add_argument("--vocab-size", type=int, default=None,
                    help="take prompt ids modulo this (for vocabularies under 40000)")
    sv.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                    help="the route to load; chat prompts are written as words "
                    "(default: %(default)s)")
    add_engine_args(bench)
    # The peer script's settings, so both engines do identical work; the dtype is serve's
    # (auto: the fastest this CPU computes), printed on the startup RESULT line.
    bench.set_defaults(func=cmd_bench, max_model_len=2048, max_num_seqs=64,
                       max_num_batched_tokens=2048)

    comp = sub.add_parser(
        "compile", help="compile every bucket of the grid into the compile cache, then exit"
    )
    comp.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                      help="model path (same as --model)")
    add_engine_args(comp)
    comp.set_defaults(func=cmd_compile)

    conv = sub.add_parser("convert", help="convert a GGUF file into a Hugging Face directory")
    conv.add_argument("gguf", help="input .gguf file")
    conv.add_argument("out_dir", help="output directory")
    conv.add_argument("--dtype", default="float32", help="weight dtype (default: %(default)s)")
    conv.set_defaults(func=cmd_convert)

    from ingot.accuracy.cli import add_validate_parser

    add_validate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.given_flags = given_flags(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    try:
        return ns.func(ns)
    except (IngotError, ValueError, FileNotFoundError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C before the server's own handler is installed (while the model loads) or in a
        # one-shot command: stop quietly with the shell's convention for SIGINT, no traceback.
        return 130


if __name__ == "__main__":
    sys.exit(main())
