"""Speculative decoding (n-gram prompt lookup) on the default model in bf16: output tok/s with
speculation off and on, in alternating child processes (one engine per process: two engines in
one process would run two OpenMP teams at half speed each).

Workloads:
* grounded: chat prompts that ask to repeat or edit a given passage or code, one request at a
  time (greedy, 128 new tokens each): the case n-gram lookup is for;
* offline: the shared offline workload (64 random-token prompts of 128 tokens, 128 new tokens
  each, all submitted at once; ../shared/bench/vllm_workloads.py), where there is little to
  look up.

Each round prints a JSON line per (workload, setting); the summary gives medians, the on/off
ratio, the mean acceptance length and whether every token matched. Usage:
  python bench/spec_decode.py [--rounds 3] [--k 3] [--workloads grounded,offline]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PASSAGES = [
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
    "    return out\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n        return self.items[-1]\n\n    def is_empty(self):\n"
    "        return not self.items\n",
    "The river rose slowly through the night. By morning the lower fields were under water, "
    "and the farmers moved their animals to the hill behind the church. Nobody had seen the "
    "river this high since the spring of the great storm, when the old bridge was carried "
    "away and the village was cut off for a week.",
]
ASKS = [
    "Repeat the following text exactly, without any comment:",
    "Rewrite the following, changing nothing except fixing any typos:",
]
SPEC = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def child(setting: str, workloads: list[str], k: int, fixed_threads: bool = False) -> None:
    from ingot import LLM, SamplingParams
    from ingot.benchmarks.workloads import WORKLOADS, prompts_for

    kwargs: dict = {"max_model_len": 2048}
    if fixed_threads:  # no adaptive thread switches (they can change oneDNN's rounding)
        kwargs["cpu_adaptive_threads"] = False
    if setting == "on":
        kwargs["speculative_config"] = {**SPEC, "num_speculative_tokens": k}
    llm = LLM(**kwargs)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4))
    engine = llm.llm_engine
    for name in workloads:
        before = engine.get_stats()["spec_decode"]
        before = before.copy() if before is not None else None
        if name == "grounded":
            tok = llm.get_tokenizer()
            prompts = [tok.apply_chat_template([{"role": "user", "content": f"{a}\n\n{p}"}],
                                               tokenize=False, add_generation_prompt=True)
                       for p in PASSAGES for a in ASKS]
            params = SamplingParams(temperature=0, max_tokens=128)
            start = time.perf_counter()
            tokens = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
                      for p in prompts]
        else:
            n, inp, out = WORKLOADS["offline"]
            params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts_for(n, inp)], params,
                                use_tqdm=False)
            tokens = [o.outputs[0].token_ids for o in outs]
        seconds = time.perf_counter() - start
        generated = sum(len(t) for t in tokens)
        stats = engine.get_stats()["spec_decode"]
        acc = None
        if stats is not None:
            drafts = stats.num_drafts - (before.num_drafts if before else 0)
            accepted = stats.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
            acc = 1 + accepted / drafts if drafts else None
        print("BENCH " + json.dumps({
            "workload": name, "setting": setting, "seconds": seconds,
            "output_tok_s": generated / seconds, "acceptance_length": acc,
            "tokens": [list(t) for t in tokens],
        }), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--workloads", default="grounded,offline")
    ap.add_argument("--child", default=None)
    ap.add_argument("--fixed-threads", action="store_true",
                    help="turn off the adaptive CPU thread count in both settings")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    if args.child:
        child(args.child, workloads, args.k, args.fixed_threads)
        return
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for setting in (("off", "on") if r % 2 == 0 else ("on", "off")):
            proc = subprocess.run(
                [sys.executable, __file__, "--child", setting, "--k", str(args.k),
                 "--workloads", args.workloads]
                + (["--fixed-threads"] if args.fixed_threads else []),
                capture_output=True, text=True, check=True)
            for line in proc.stdout.splitlines():
                if line.startswith("BENCH "):
                    rec = json.loads(line[6:])
                    results.setdefault((rec["workload"], setting), []).append(rec)
                    print(json.dumps({k: v for k, v in rec.items() if k != "tokens"}), flush=True)
    print("\n| workload | off tok/s (median) | on tok/s (median) | on / off | "
          "acceptance length | off runs agree | on = off, runs |")
    print("|---|---|---|---|---|---|---|")
    for name in workloads:
        off, on = results[(name, "off")], results[(name, "on")]
        m_off = statistics.median(x["output_tok_s"] for x in off)
        m_on = statistics.median(x["output_tok_s"] for x in on)
        acc = [x["acceptance_length"] for x in on if x["acceptance_length"] is not None]
        off_agree = all(x["tokens"] == off[0]["tokens"] for x in off)
        on_same = sum(x["tokens"] == off[0]["tokens"] for x in on)
        print(f"| {name} | {m_off:.1f} | {m_on:.1f} | {m_on / m_off:.2f}x | "
              f"{statistics.median(acc) if acc else 0:.2f} | {off_agree} | "
              f"{on_same} of {len(on)} |")


if __name__ == "__main__":
    main()
