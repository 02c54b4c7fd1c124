"""Prompt embeddings: greedy output from ``embed_tokens(ids)`` equals output from the ids
(offline and over HTTP, both wire formats), mixed batches equal separate runs, chunked prefill
slices the embeds, the prefix cache keys embeds by content; and every hostile payload is a 400
with the server serving the next request."""

from __future__ import annotations

import base64
import io
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save
from server_utils import TINY_FLAGS, run_server

from ingot import LLM, SamplingParams

IDS = [3, 17, 92, 45, 200, 11, 8, 250, 77, 5, 133] * 5  # 55 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def embed_weight(tiny_llama_dir):
    return load_file(str(tiny_llama_dir / "model.safetensors"))["model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # A 32-token budget chunks the 55-token prompt; 4 prompts may share a prefill step.
    engine = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, enable_prompt_embeds=True,
                 max_num_batched_tokens=32, max_num_seqs=4,
                 additional_config={"num_batched_tokens_buckets": [16, 32]})
    yield engine
    engine.llm_engine.shutdown()


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_embeds_equal_ids_mixed_and_chunked(llm, embed_weight):
    ref = _tokens(llm.generate([IDS, IDS[:9]], GREEDY))
    alone = _tokens(llm.generate([{"prompt_embeds": embed_weight[IDS]}], GREEDY))
    assert alone == ref[:1]  # chunked: 55 rows over a 32-token budget
    mixed = _tokens(llm.generate([{"prompt_embeds": embed_weight[IDS]}, IDS[:9]], GREEDY))
    assert mixed == ref
    half = _tokens(llm.generate([{"prompt_embeds": embed_weight[IDS].to(torch.bfloat16)}], GREEDY))
    assert len(half[0]) == 10  # bf16 embeds are accepted (and cast to the model dtype)
    # Broken twin: embeddings of other tokens must not give the same output.
    other = _tokens(llm.generate([{"prompt_embeds": embed_weight[[i + 1 for i in IDS]]}], GREEDY))
    assert other != ref[:1]


def test_prefix_cache_keys_embeds_by_content(llm, embed_weight):
    embeds = embed_weight[IDS]
    first = llm.generate([{"prompt_embeds": embeds}], GREEDY)[0]
    again = llm.generate([{"prompt_embeds": embeds.clone()}], GREEDY)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # Its placeholder ids (zeros) must not find the embeds' blocks, nor the ids' blocks.
    zeros = llm.generate([[0] * len(IDS)], GREEDY)[0]
    assert zeros.num_cached_tokens == 0
    other = llm.generate([{"prompt_embeds": embed_weight[[i + 2 for i in IDS]]}], GREEDY)[0]
    assert other.num_cached_tokens == 0  # other content (never sent before)


def test_offline_rejections(tiny_llama_dir, llm, embed_weight):
    hidden = embed_weight.shape[1]
    bad = [
        (torch.ones(4, hidden, dtype=torch.int64), "float32"),
        (torch.ones(4, hidden + 1), "shape"),
        (torch.ones(300, hidden), "max_model_len"),
        (torch.full((4, hidden), float("nan")), "NaN"),
        (torch.ones(4, hidden).to_sparse(), "dense"),
        (torch.ones(4, hidden, device="meta"), "meta device"),
        ([[0.0] * hidden], "torch.Tensor"),
    ]
    for tensor, fragment in bad:
        with pytest.raises(ValueError, match=fragment):
            llm.generate([{"prompt_embeds": tensor}], GREEDY)
    with pytest.raises(ValueError, match="repetition_penalty"):
        llm.generate([{"prompt_embeds": embed_weight[IDS]}],
                     SamplingParams(max_tokens=2, repetition_penalty=1.2))
    off = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, max_num_seqs=2)
    try:
        with pytest.raises(ValueError, match="--enable-prompt-embeds"):
            off.generate([{"prompt_embeds": embed_weight[IDS]}], GREEDY)
    finally:
        off.llm_engine.shutdown()


# ---- HTTP ---------------------------------------------------------------------------------------


def b64_torch(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


def b64_safetensors(tensor: torch.Tensor) -> str:
    return base64.b64encode(save({"embeds": tensor.contiguous()})).decode()


class _Exploit:
    """A pickle that would run code when loaded by a plain torch.load."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    args = [str(tiny_llama_dir), *TINY_FLAGS, "--enable-prompt-embeds"]
    with run_server(args, tmp_path_factory.mktemp("logs")) as s:
        yield s


def _complete(server, **body):
    return server.json("POST", "/v1/completions",
                       {"max_tokens": 10, "temperature": 0, **body})


def test_http_embeds_equal_ids_in_both_formats(server, embed_weight):
    status, ref = _complete(server, prompt=IDS)
    assert status == 200, ref
    for encode in (b64_torch, b64_safetensors):
        status, body = _complete(server, prompt_embeds=encode(embed_weight[IDS]))
        assert status == 200, body
        assert body["choices"][0]["text"] == ref["choices"][0]["text"]
        assert body["usage"]["prompt_tokens"] == len(IDS)


def test_http_hostile_payloads_are_400(server, embed_weight, tmp_path):
    hidden = embed_weight.shape[1]
    marker = tmp_path / "pwned"
    oob = torch.sparse_coo_tensor(torch.tensor([[0, 10**6], [0, 1]]), torch.ones(2), (4, hidden),
                                  check_invariants=False)
    header = json.dumps({"embeds": {"dtype": "F32", "shape": [10**9, hidden],
                                    "data_offsets": [0, 8]}}).encode()
    huge_safetensors = base64.b64encode(struct.pack("<Q", len(header)) + header + b"\0" * 8).decode()
    cases = {
        "pickle with __reduce__": b64_torch(_Exploit(str(marker))),
        "out-of-bounds sparse COO": b64_torch(oob),
        "tiny payload, huge shape (torch.save)": b64_torch(torch.zeros(1).expand(10**6, hidden)),
        "tiny payload, huge shape (safetensors)": huge_safetensors,
        "integer dtype": b64_torch(torch.ones(4, hidden, dtype=torch.int32)),
        "wrong hidden size": b64_safetensors(torch.ones(4, hidden + 1)),
        "more rows than max_model_len": b64_safetensors(torch.ones(300, hidden)),
        "NaN values": b64_torch(torch.full((4, hidden), float("nan"))),
        "not base64": "%%%not-base64%%%",
        "oversized before decoding": "A" * (8 * 2**20 - 1000),
    }
    for name, payload in cases.items():
        status, body = _complete(server, prompt_embeds=payload)
        assert status in (400, 413), (name, body)
        assert body["error"]["type"] == "invalid_request_error", (name, body)
        status, ok = _complete(server, prompt=IDS[:5])  # the server serves the next request
        assert status == 200, (name, ok)
    assert not marker.exists()
    status, body = _complete(server, prompt="x", prompt_embeds=b64_torch(embed_weight[IDS]))
    assert status == 400 and "not both" in body["error"]["message"]
