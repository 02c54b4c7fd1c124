"""Issue #31 items 3, 10 and 11: what a request carries into the engine, against a real
`ingot serve` (and the offline ``LLM``).

- Every token id a request carries is one of the model's (``0 <= id < vocab_size``): a 400 that
  names the field, before anything reaches the engine's step.
- A failure while admitting or finishing one request fails that request only: a 500 with an
  error id (nothing of the server's internals) for the engine's fault, a 400 for the request's
  own; the request beside it completes (tests/e2e/fault_admission_cli.py injects the faults).
- ``cache_salt`` isolates tenants' cached prefixes.
- ``prompt_embeds`` through the official ``openai`` client (``prompt=""``); a torch.save zip bomb
  and a meta tensor are 400s.

Each attack: a 4xx (or the one 500) within 10 s, /health within 2 s throughout, the same greedy
answer afterwards and nothing left running.
"""

from __future__ import annotations

import base64
import io
import json
import sys
import threading
import time
import zipfile
from pathlib import Path

import openai
import pytest
import torch
from fault_admission_cli import (
    ENGINE_FAULT,
    FINISH_FAULT,
    LEAKY_MESSAGE,
    REQUEST_FAULT,
)
from safetensors.torch import load_file
from server_utils import (
    TINY_FLAGS,
    HealthWatch,
    assert_client_error,
    assert_recovered,
    greedy_answer,
    metric,
    run_server,
)

from ingot import LLM, SamplingParams
from ingot.core.request import Request

VOCAB = 259  # the tiny Llama's embedding rows (tests/conftest.py)
LAUNCHER = [sys.executable, str(Path(__file__).with_name("fault_admission_cli.py"))]
LIVENESS_S = 10.0  # the bar for every attack's answer
LEAKS = ("Traceback", 'File "', ".py", "/site-packages/", "/src/ingot", "grammar_matcher")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    args = [str(tiny_llama_dir), *TINY_FLAGS, "--enable-prompt-embeds"]
    with run_server(args, tmp_path_factory.mktemp("logs"), launcher=LAUNCHER) as s:
        yield s


@pytest.fixture(scope="module")
def baseline(server) -> str:
    return greedy_answer(server)


def _timed(server, path: str, body: dict) -> tuple[int, bytes]:
    start = time.monotonic()
    status, _, raw = server.request("POST", path, body)
    assert time.monotonic() - start < LIVENESS_S, (path, body)
    return status, raw


def _complete(**body) -> dict:
    return {"max_tokens": 4, "temperature": 0, **body}


def _chat(**body) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, **body}


# ---- item 3: token ids -----------------------------------------------------------------------


def test_token_ids_past_the_vocabulary_are_a_400_naming_the_field(server, baseline):
    over = [
        ("/v1/completions", _complete(prompt="hi", stop_token_ids=[VOCAB]), "stop_token_ids"),
        ("/v1/completions", _complete(prompt="hi", stop_token_ids=[2**40]), "stop_token_ids"),
        # The crash the issue reports: an override stop token handed to the grammar matcher.
        ("/v1/completions", _complete(prompt="hi", stop_token_ids=[10**9],
                                      structured_outputs={"regex": "a+"}), "stop_token_ids"),
        ("/v1/completions", _complete(prompt="hi", stop_token_ids=[VOCAB], stream=True),
         "stop_token_ids"),
        ("/v1/completions", _complete(prompt=[5, VOCAB]), "prompt"),
        ("/v1/completions", _complete(prompt=[[5], [2**40]]), "prompt"),
        ("/v1/chat/completions", _chat(stop_token_ids=[VOCAB]), "stop_token_ids"),
        ("/v1/chat/completions", _chat(structured_outputs={
            "regex": "a+", "reasoning_end_token_ids": [VOCAB]}),
         "structured_outputs.reasoning_end_token_ids"),
        ("/detokenize", {"tokens": [5, 2**40]}, "tokens"),
    ]
    at_limit = [
        ("/v1/completions", _complete(prompt="hi", stop_token_ids=[0, VOCAB - 1])),
        ("/v1/completions", _complete(prompt=[0, VOCAB - 1])),
        ("/v1/completions", _complete(prompt="hi", stop_token_ids=[VOCAB - 1],
                                      structured_outputs={"regex": "a+"})),
        ("/v1/chat/completions", _chat(stop_token_ids=[VOCAB - 1])),
        ("/detokenize", {"tokens": [0, VOCAB - 1]}),
    ]
    with HealthWatch(server) as watch:
        for path, body, field in over:
            status, raw = _timed(server, path, body)
            err = assert_client_error(status, raw, f"{field} must be token ids",
                                      f"0 <= id < {VOCAB}")
            assert status == 400 and err["param"] == field, (body, err)
        for path, body in at_limit:
            status, raw = _timed(server, path, body)
            assert status == 200, (body, raw[:300])
    watch.assert_healthy()
    assert_recovered(server, baseline)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, max_num_seqs=4)
    yield engine
    engine.llm_engine.shutdown()


def test_offline_token_ids_are_checked_and_the_engine_keeps_serving(llm):
    greedy = SamplingParams(temperature=0, max_tokens=4)
    ref = llm.generate([5, 6, 7], greedy)[0].outputs[0].token_ids
    for prompt, params, field in [
        ([10**9], greedy, "prompt_token_ids"),
        ({"prompt_token_ids": [5, VOCAB]}, greedy, "prompt_token_ids"),
        ([5, 6], SamplingParams(max_tokens=2, stop_token_ids=[2**40]), "stop_token_ids"),
        ([5, 6], SamplingParams(max_tokens=2, stop_token_ids=[VOCAB],
                                structured_outputs={"regex": "a+"}), "stop_token_ids"),
    ]:
        with pytest.raises(ValueError, match=f"^{field} must be token ids"):
            llm.generate(prompt, params)
    assert llm.generate([0, VOCAB - 1], greedy)[0].outputs[0].token_ids  # at the limit
    assert llm.generate([5, 6, 7], greedy)[0].outputs[0].token_ids == ref


def _core_outputs(engine, ids: set[str]) -> dict[str, list]:
    """Step the engine core until every request in ``ids`` has finished."""
    outs: dict[str, list] = {}
    deadline = time.monotonic() + 60
    while not all(outs.get(i) and outs[i][-1].finish_status for i in ids):
        assert time.monotonic() < deadline, outs
        for out in engine.engine_core.step():
            outs.setdefault(out.req_id, []).append(out)
    return outs


def _admission_fault(engine) -> None:
    """The reported crash, the input check bypassed: a request whose override stop token is past
    the vocabulary reaches the grammar matcher inside admission, beside a normal request. Only it
    fails (an error id: the engine's fault); the other one runs to its end."""
    bad = SamplingParams(max_tokens=2, stop_token_ids=[VOCAB], structured_outputs={"regex": "a+"})
    engine.engine_core.add_request(Request("bad", [5, 6], bad))
    engine.engine_core.add_request(
        Request("good", [5, 6], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    outs = _core_outputs(engine, {"bad", "good"})
    (failed,) = outs["bad"]
    assert failed.error_id and failed.error_id in failed.error
    assert "grammar_matcher" not in failed.error and "vocabulary range" not in failed.error
    assert sum(len(o.new_token_ids) for o in outs["good"]) == 6
    assert outs["good"][-1].error is None


def test_a_fault_while_admitting_fails_that_request_only_in_process(llm):
    engine = llm.llm_engine
    free = engine.get_stats()["kv_blocks_free"]
    _admission_fault(engine)
    assert engine.get_stats()["kv_blocks_free"] == free
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate([5, 6], greedy)[0].outputs[0].token_ids) == 3


def test_offline_cache_salt(llm):
    prompt = list(range(3, 3 + 100))  # 3 full blocks
    greedy = SamplingParams(temperature=0, max_tokens=2)

    def cached(**salt) -> int:
        return llm.generate({"prompt_token_ids": prompt, **salt}, greedy)[0].num_cached_tokens

    assert cached(cache_salt="a") == 0 and cached(cache_salt="a") == 96
    assert cached(cache_salt="b") == 0 and cached() == 0 and cached() == 96
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        cached(cache_salt="")


@pytest.mark.slow
def test_a_fault_while_admitting_fails_that_request_only_on_a_dp_replica(tiny_llama_dir):
    """The same on data-parallel replicas, where it used to end the replica's loop."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, max_num_seqs=4,
              data_parallel_size=2, cpu_adaptive_threads=False)
    try:
        for _ in range(2):  # least-loaded routing spreads them over both replicas
            _admission_fault(llm.llm_engine)
        greedy = SamplingParams(temperature=0, max_tokens=3)
        assert len(llm.generate([[5, 6], [7, 8]], greedy)) == 2  # both replicas still serve
    finally:
        llm.llm_engine.shutdown()


def _assert_server_error(status: int, raw: bytes) -> dict:
    """The engine's fault: a 500 in OpenAI's shape with an error id, and no internals."""
    assert status == 500, (status, raw[:300])
    text = raw.decode(errors="replace")
    for leak in LEAKS:
        assert leak not in text, f"error body leaks {leak!r}: {text[:300]}"
    err = json.loads(raw)["error"]
    assert err["type"] == "server_error" and err["code"] == 500 and "error id" in err["message"]
    return err


def test_a_fault_while_admitting_or_finishing_fails_that_request_only(server, baseline):
    results: dict[str, tuple[int, bytes]] = {}

    def normal() -> None:
        results["normal"] = _timed(server, "/v1/completions",
                                   _complete(prompt=[5, 6, 7], max_tokens=48, ignore_eos=True))

    with HealthWatch(server) as watch:
        beside = threading.Thread(target=normal)
        beside.start()
        status, raw = _timed(server, "/v1/completions", _complete(prompt=[*ENGINE_FAULT, 5]))
        err = _assert_server_error(status, raw)
        error_id = err["message"].split("error id ")[1].split(";")[0]
        # Streamed: the headers are out before the engine fails it, so the error is an event.
        status, _, raw = server.request("POST", "/v1/completions",
                                        _complete(prompt=[*ENGINE_FAULT, 6], stream=True))
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        assert status == 200 and events[-1]["error"]["code"] == 500, raw[:300]
        assert not any(leak in raw.decode() for leak in LEAKS)
        # The request's own fault (a ValueError inside admission) is a 400 with its message.
        status, raw = _timed(server, "/v1/completions", _complete(prompt=[*REQUEST_FAULT, 5]))
        assert_client_error(status, raw, "this request's own fault")
        # A fault while finishing: the request already has its answer, and keeps it.
        status, raw = _timed(server, "/v1/completions",
                             _complete(prompt=[*FINISH_FAULT, 5], max_tokens=3, ignore_eos=True))
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
        beside.join(timeout=LIVENESS_S)
    watch.assert_healthy()
    status, raw = results["normal"]
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 48
    log = server.log()
    assert error_id in log and LEAKY_MESSAGE in log  # the details are in the log, by the id
    assert "injected fault while finishing" in log
    assert_recovered(server, baseline)


# ---- item 10: cache_salt -----------------------------------------------------------------------


def test_cache_salt_isolates_cached_prefixes(server, baseline):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # 180 tokens: 5 full blocks

    def hits(path: str, **body) -> float:
        before = metric(server.metrics(), "ingot:prefix_cache_hits_total")
        payload = _complete(prompt=prompt, **body) if path == "/v1/completions" else _chat(
            messages=[{"role": "user", "content": prompt}], **body)
        status, raw = _timed(server, path, payload)
        assert status == 200, raw[:300]
        return metric(server.metrics(), "ingot:prefix_cache_hits_total") - before

    for path in ("/v1/completions", "/v1/chat/completions"):
        assert hits(path, cache_salt=f"tenant-a{path}") == 0
        assert hits(path, cache_salt=f"tenant-a{path}") > 0  # the same salt shares
        assert hits(path, cache_salt=f"tenant-b{path}") == 0  # another tenant's does not
        assert hits(path) == 0  # nor does an unsalted request
        assert hits(path) > 0
    with HealthWatch(server) as watch:
        for bad in ("", 5, ["a"]):
            status, raw = _timed(server, "/v1/completions", _complete(prompt="hi", cache_salt=bad))
            err = assert_client_error(status, raw)
            assert err["param"] == "cache_salt", err
    watch.assert_healthy()
    assert_recovered(server, baseline)


# ---- item 11: prompt_embeds --------------------------------------------------------------------


@pytest.fixture(scope="module")
def embed_weight(tiny_llama_dir):
    return load_file(str(tiny_llama_dir / "model.safetensors"))["model.embed_tokens.weight"]


def _torch_save(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def test_prompt_embeds_through_the_official_client(server, embed_weight):
    ids = [3, 17, 92, 45, 200, 11, 8, 250, 77, 5]
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    model = client.models.list().data[0].id
    ref = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    b64 = base64.b64encode(_torch_save(embed_weight[ids])).decode()
    # vLLM's documented call: the client requires prompt, so it sends an empty one.
    out = client.completions.create(model=model, prompt="", max_tokens=8, temperature=0,
                                    extra_body={"prompt_embeds": b64})
    assert out.choices[0].text == ref.choices[0].text and out.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.completions.create(model=model, prompt="x", max_tokens=8,
                                  extra_body={"prompt_embeds": b64})


def test_zip_bomb_and_meta_tensor_are_400(server, baseline, embed_weight):
    hidden = embed_weight.shape[1]
    # 64 MiB of zeros (far past max_model_len x hidden x 4 = 64 KiB), deflated into the entries of
    # a torch.save zip: tens of kilobytes on the wire, within the encoded-size bound.
    rows = 64 * 2**20 // (hidden * 4)
    plain = zipfile.ZipFile(io.BytesIO(_torch_save(torch.zeros(rows, hidden))))
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for info in plain.infolist():
            out.writestr(info.filename, plain.read(info))
    assert len(bomb.getvalue()) < 256 * 1024
    meta = _torch_save(torch.zeros(4, hidden, device="meta"))
    ids = list(range(3, 3 + 255))  # at the limit: 255 rows leave room for one token
    at_limit = base64.b64encode(_torch_save(embed_weight[ids])).decode()
    with HealthWatch(server) as watch:
        for payload, fragment in ((bomb.getvalue(), "compressed"), (meta, "meta")):
            status, raw = _timed(server, "/v1/completions", _complete(
                prompt="", prompt_embeds=base64.b64encode(payload).decode()))
            err = assert_client_error(status, raw, fragment)
            assert status == 400 and err["param"] == "prompt_embeds", err
        status, raw = _timed(server, "/v1/completions",
                             _complete(prompt="", prompt_embeds=at_limit, max_tokens=1))
        assert status == 200 and json.loads(raw)["usage"]["prompt_tokens"] == 255, raw[:300]
    watch.assert_healthy()
    assert_recovered(server, baseline)
