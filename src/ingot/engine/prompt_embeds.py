"""Prompt embeddings (``--enable-prompt-embeds``): a prompt given as a ``[seq_len, hidden]``
tensor instead of token ids. One place checks every tensor, whatever it came from
(``check_prompt_embeds``), and one place decodes the HTTP wire formats
(``decode_prompt_embeds``).

The wire formats, both base64:
- safetensors bytes holding one tensor (preferred: no pickle at all);
- ``torch.save(tensor)`` (vLLM's format).

Decoding is defensive, because these bytes come from the network: the encoded size is bounded
before anything is decoded (no tensor a request could declare is larger than
``max_model_len x hidden_size x 4`` bytes); a safetensors header is read and checked (one dense
tensor, an allowed dtype, a bounded shape whose byte count matches its data) before its data is
touched; a ``torch.save`` zip is opened with Python's ``zipfile`` first: every entry must be
stored uncompressed (as torch.save writes them) with sizes within the payload, so a zip bomb
(kilobytes of deflate declaring gigabytes) is refused unread, and torch reads a copy rebuilt from
exactly the entries checked (no difference between two zip parsers can show it anything else);
it goes through ``torch.load(weights_only=True)`` (the restricted unpickler: no ``__reduce__``,
no arbitrary callables) inside ``torch.sparse.check_sparse_tensor_invariants()``, so a sparse
tensor with out-of-range indices is refused while it is rebuilt, before anything could densify
it (the CVE-2025-62164 class of bug); and whatever was decoded must then be a plain dense CPU
tensor (not ``meta``, which has no data) of float32, bfloat16 or float16 with shape
``[1 <= n <= max_model_len, hidden_size]`` and finite values. Anything else raises
``ValueError`` (a 400 on the HTTP server).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import pickle
import struct
import zipfile

import torch

ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The token id an embeds row stands in for while scheduling (never embedded: the runner
# replaces the row). Such a request's prompt_token_ids are these placeholders, one per row.
PROMPT_EMBEDS_PLACEHOLDER = 0
_SAFETENSORS_DTYPES = {"F32": 4, "BF16": 2, "F16": 2}
# Room for a torch.save zip's metadata or a safetensors header around the tensor data.
_ENVELOPE_BYTES = 64 * 1024


def check_prompt_embeds(embeds: object, hidden_size: int, max_model_len: int) -> torch.Tensor:
    """The tensor, contiguous on the CPU, if it is an acceptable prompt; else ValueError."""
    if type(embeds) is not torch.Tensor and not isinstance(embeds, torch.nn.Parameter):
        raise ValueError(
            f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}"
        )
    if embeds.layout != torch.strided:
        raise ValueError(f"prompt_embeds must be a dense tensor, got layout {embeds.layout}")
    if embeds.is_meta:
        raise ValueError("prompt_embeds must hold data; got a tensor on the meta device (a "
                         "shape without values)")
    if embeds.dtype not in ALLOWED_DTYPES:
        raise ValueError(
            f"prompt_embeds must be float32, bfloat16 or float16, got {embeds.dtype}"
        )
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        raise ValueError(
            f"prompt_embeds must have shape [seq_len, {hidden_size}] (the model's hidden size), "
            f"got {list(embeds.shape)}"
        )
    if not 1 <= embeds.shape[0] <= max_model_len:
        raise ValueError(
            f"prompt_embeds has {embeds.shape[0]} rows; give between 1 and max_model_len "
            f"({max_model_len})"
        )
    embeds = embeds.detach().to("cpu").contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError("prompt_embeds holds NaN or infinite values")
    return embeds


def content_hash(embeds: torch.Tensor) -> bytes:
    """What the prefix cache keys an embeds request's blocks by (its placeholder token ids
    say nothing about its content)."""
    h = hashlib.sha256(b"prompt_embeds")
    h.update(str((embeds.dtype, tuple(embeds.shape))).encode())
    h.update(embeds.view(torch.uint8).numpy().tobytes())
    return h.digest()


def max_encoded_chars(hidden_size: int, max_model_len: int) -> int:
    raw = max_model_len * hidden_size * 4 + _ENVELOPE_BYTES
    return 4 * math.ceil(raw / 3)


def decode_prompt_embeds(data: str, hidden_size: int, max_model_len: int) -> torch.Tensor:
    """base64 safetensors or torch.save bytes -> a checked tensor (see the module docstring)."""
    if not isinstance(data, str):
        raise ValueError("prompt_embeds must be a base64 string")
    limit = max_encoded_chars(hidden_size, max_model_len)
    if len(data) > limit:
        raise ValueError(
            f"prompt_embeds is {len(data)} base64 characters; no acceptable tensor "
            f"([<= {max_model_len}, {hidden_size}] float32) needs more than {limit}"
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("prompt_embeds is not valid base64") from None
    if raw[:2] == b"PK":
        tensor = _load_torch_save(raw)
    else:
        tensor = _load_safetensors(raw, hidden_size, max_model_len)
    if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu":
        raise ValueError(f"prompt_embeds must be a CPU tensor, got one on {tensor.device.type}")
    return check_prompt_embeds(tensor, hidden_size, max_model_len)


def _checked_zip(raw: bytes) -> bytes:
    """The torch.save zip rebuilt from its entries, each checked to be stored uncompressed (as
    torch.save writes them) with sizes within the payload: what torch then reads expands to no
    more than the payload already is."""
    refused = "prompt_embeds (torch.save format) was refused: "
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            entries = archive.infolist()
            for info in entries:
                if info.compress_type != zipfile.ZIP_STORED:
                    raise ValueError(
                        f"{refused}entry {info.filename[:100]!r} is compressed; torch.save "
                        "stores its entries uncompressed (send the bytes torch.save wrote, or "
                        "safetensors)"
                    )
            declared = sum(i.file_size for i in entries)
            if declared > len(raw) or any(i.compress_size != i.file_size for i in entries):
                raise ValueError(f"{refused}its entries declare {declared} bytes, more than the "
                                 f"{len(raw)}-byte payload holds")
            out = io.BytesIO()
            with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rebuilt:
                for info in entries:
                    rebuilt.writestr(info.filename, archive.read(info))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, KeyError,
            NotImplementedError, UnicodeDecodeError) as exc:
        raise ValueError(f"{refused}not a readable zip ({exc})"[:500]) from None
    return out.getvalue()


def _load_torch_save(raw: bytes) -> object:
    raw = _checked_zip(raw)
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(
            "prompt_embeds (torch.save format) holds something other than plain tensors; it "
            "was refused unread (send one dense tensor, preferably as safetensors)"
        ) from None
    except (RuntimeError, ValueError, TypeError, KeyError, EOFError,
            IndexError, AttributeError, zipfile.BadZipFile, OSError, NotImplementedError) as exc:
        raise ValueError(f"prompt_embeds (torch.save format) was refused: {exc}"[:500]) from None


def _load_safetensors(raw: bytes, hidden_size: int, max_model_len: int) -> torch.Tensor:
    bad = "prompt_embeds is neither base64 safetensors nor torch.save bytes"
    if len(raw) < 8:
        raise ValueError(bad)
    (header_len,) = struct.unpack("<Q", raw[:8])
    if header_len > min(len(raw) - 8, _ENVELOPE_BYTES):
        raise ValueError(bad)
    try:
        header = json.loads(raw[8 : 8 + header_len])
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(bad) from None
    if not isinstance(header, dict):
        raise ValueError(bad)
    header.pop("__metadata__", None)
    if len(header) != 1:
        raise ValueError(f"prompt_embeds must hold exactly one tensor, got {len(header)}")
    (info,) = header.values()
    if not isinstance(info, dict):
        raise ValueError(bad)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"prompt_embeds must be F32, BF16 or F16, got {dtype!r}")
    if (not isinstance(shape, list) or len(shape) != 2
            or not all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"prompt_embeds must have shape [seq_len, {hidden_size}], got {shape!r}")
    if shape[1] != hidden_size or not 1 <= shape[0] <= max_model_len:
        raise ValueError(
            f"prompt_embeds must have shape [1..{max_model_len}, {hidden_size}], got {shape}"
        )
    nbytes = shape[0] * shape[1] * _SAFETENSORS_DTYPES[dtype]
    if offsets != [0, nbytes] or len(raw) != 8 + header_len + nbytes:
        raise ValueError("prompt_embeds: the safetensors data does not match its declared shape")
    from safetensors.torch import load

    try:
        (tensor,) = load(raw).values()
    except Exception as exc:  # noqa: BLE001 - any parse failure is the client's payload
        raise ValueError(f"prompt_embeds (safetensors) was refused: {exc}"[:500]) from None
    return tensor
