"""The wire between ingot's processes: typed messages in authenticated frames (issue #31).

Every zmq socket between ingot's processes (a TP rank and its executor, a data-parallel replica
and the front end; on one host over ipc, across hosts over TCP) carries only frames made here:

* A frame is one zmq message, ``mac | len(header) | header | body``: ``header`` is msgpack
  ``(sender index, kind)``, ``body`` the message, msgpack-encoded by msgspec, and ``mac`` (32
  bytes) HMAC-SHA256 over the rest under the launch's key. The receiver checks the MAC
  (``hmac.compare_digest``) before it reads anything: a frame that fails is dropped and logged
  (one line per ``_LOG_EVERY_S`` at most), never decoded. (One message, not three parts: a
  multipart message cost a round trip about 60 us more over ipc.)
* The receiver decodes a body against the type its schema declares for the kind (``Link``):
  dataclasses, msgspec Structs, enums, builtins, and tensors / arrays rebuilt from raw bytes, a
  dtype from a fixed table and a shape. Nothing on the wire names code to run: a function sent
  by ``collective_rpc`` travels as a name that the receiver looks up among those registered with
  ``rpc_function``; an error travels as its class names and message and is rebuilt as a builtin
  exception or one of ingot's ``IngotError`` classes (``RemoteError``).
* The key is per launch. Local children get a fresh random key in their spawn arguments
  (multiprocessing's pipe, not a socket). Across hosts every node reads the same secret from
  ``INGOT_RPC_SECRET`` or ``--rpc-secret-file`` (``shared_secret``), and TCP sockets also run
  zmq's CURVE with keys derived from it (``bind``, ``connect``): a peer without the secret cannot
  complete the handshake, so it can neither send a frame nor take a share of a PUSH socket's
  messages, and the traffic is encrypted.

Light on purpose (msgspec, zmq and the standard library): spawned children import it first.
torch and numpy are imported only when a tensor or array travels.
"""

from __future__ import annotations

import builtins
import hmac
import importlib
import logging
import math
import os
import secrets
import struct
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import zmq
from zmq.utils import z85

from ingot.errors import IngotError

logger = logging.getLogger("ingot")

SECRET_ENV = "INGOT_RPC_SECRET"
MIN_SECRET_CHARS = 16
_SECRET_HINT = ("export INGOT_RPC_SECRET=$(python -c 'import secrets; "
                "print(secrets.token_hex(32))') with the same value on every node")
_LOG_EVERY_S = 10.0

# ---- the secret ------------------------------------------------------------------------------


def new_key() -> bytes:
    """A fresh per-launch key, for children on this host only."""
    return secrets.token_bytes(32)


def shared_secret(secret_file: str | None) -> bytes | None:
    """The secret every node of a multi-node launch shares: ``--rpc-secret-file``'s contents
    (surrounding whitespace stripped), else ``INGOT_RPC_SECRET``; None if neither is set."""
    if secret_file:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"--rpc-secret-file {secret_file}: cannot read it "
                             f"({exc.strerror})") from None
        source = f"--rpc-secret-file {secret_file}"
    else:
        value = os.environ.get(SECRET_ENV, "").strip()
        if not value:
            return None
        secret, source = value.encode(), SECRET_ENV
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{source} holds {len(secret)} characters; a secret needs at least "
                         f"{MIN_SECRET_CHARS} (e.g. {_SECRET_HINT})")
    return secret


def require_shared_secret(secret_file: str | None, what: str) -> bytes:
    """``shared_secret``, which a launch over several nodes (``what``) cannot do without."""
    secret = shared_secret(secret_file)
    if secret is None:
        raise ValueError(
            f"{what} talks to other nodes over TCP, which needs a secret every node shares: "
            f"{_SECRET_HINT}, or give --rpc-secret-file PATH (a file only you can read) on "
            "every node (docs/serving.md, Security)")
    return secret


# ---- functions that collective_rpc may name --------------------------------------------------

_RPC_FUNCTIONS: dict[str, Callable[..., Any]] = {}
# Modules whose registered functions this process may import on first use: its own, and those
# its parent passed in the spawn arguments (``allow_rpc_modules``). Never a name from the wire.
_RPC_MODULES: set[str] = set()

F = TypeVar("F", bound=Callable[..., Any])


def _module_of(fn: Callable[..., Any]) -> str:
    # A spawned child imports its parent's main script as __mp_main__.
    return "__main__" if fn.__module__ == "__mp_main__" else fn.__module__


def rpc_function(fn: F) -> F:
    """Register a module-level function ``fn(worker, *args, **kwargs)`` so that
    ``collective_rpc(fn, ...)`` can run it on workers in other processes (by name: the worker
    finds it in this registry, importing its module if the engine's process registered it)."""
    if "<" in fn.__qualname__:
        raise ValueError(f"rpc_function registers module-level functions; "
                         f"{fn.__qualname__} is not one")
    _RPC_FUNCTIONS[rpc_name(fn)] = fn
    _RPC_MODULES.add(_module_of(fn))
    return fn


def rpc_name(fn: Callable[..., Any]) -> str:
    return f"{_module_of(fn)}:{fn.__qualname__}"


def rpc_modules() -> tuple[str, ...]:
    """The modules whose RPC functions a child of this process may import."""
    return tuple(sorted(_RPC_MODULES))


def allow_rpc_modules(modules: tuple[str, ...]) -> None:
    _RPC_MODULES.update(modules)


class RpcName:
    """A registered function as it arrives from the wire: a name, resolved when called."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"RpcName({self.name!r})"

    def resolve(self) -> Callable[..., Any]:
        fn = _RPC_FUNCTIONS.get(self.name)
        module = self.name.partition(":")[0]
        if fn is None and module in _RPC_MODULES and module != "__main__":
            importlib.import_module(module)  # registers its functions
            fn = _RPC_FUNCTIONS.get(self.name)
        if fn is None:
            raise ValueError(f"{self.name} is not a registered RPC function here: decorate it "
                             "with @rpc_function (ingot.distributed.wire) at module level")
        return fn


# ---- errors ----------------------------------------------------------------------------------


def _error_classes() -> dict[str, type[BaseException]]:
    """What an error may be rebuilt as: the builtin exceptions and ingot's own (loaded here)."""
    known: dict[str, type[BaseException]] = {
        name: cls for name, cls in vars(builtins).items()
        if isinstance(cls, type) and issubclass(cls, Exception)}
    todo: list[type[BaseException]] = [IngotError]
    while todo:
        cls = todo.pop()
        known[f"{cls.__module__}.{cls.__qualname__}"] = cls
        todo.extend(cls.__subclasses__())
    return known


def _class_name(cls: type) -> str:
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


class RemoteError(msgspec.Struct, array_like=True):
    """An exception raised in another process, as data: its class and bases (most derived
    first), its message and its traceback (for the log, never for a client)."""

    classes: list[str]
    message: str
    traceback: str = ""

    @classmethod
    def of(cls, exc: BaseException, traceback: str = "") -> RemoteError:
        args = exc.args
        message = args[0] if len(args) == 1 and isinstance(args[0], str) else str(exc)
        return cls([_class_name(c) for c in type(exc).__mro__], message, traceback)

    def rebuild(self, where: str) -> Exception:
        """The nearest class this process knows (a ValueError stays a ValueError, so the server
        still answers 400), with the remote traceback as a note (``where``: who raised it)."""
        known = _error_classes()
        for name in self.classes:
            cls = known.get(name)
            if cls is None:
                continue
            try:
                exc = cls(self.message)
            except Exception:  # noqa: BLE001 - a constructor that wants other arguments
                continue
            break
        else:
            exc = RuntimeError(self.message)
        if self.traceback:
            exc.add_note(f"raised by {where}:\n{self.traceback}")
        return exc  # type: ignore[return-value]


# ---- tensors and arrays as raw bytes ---------------------------------------------------------

_TENSOR, _NDARRAY, _RPC = 1, 2, 3
# A dtype travels as its index here: a fixed table, never a name looked up.
_TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
                 "uint8", "bool", "float8_e4m3fn", "float8_e5m2")
_NUMPY_DTYPES = ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8",
                 "uint16", "uint32", "uint64", "bool")
_MAX_DIMS = 8


def _pack_array(kind: int, dtype_index: int, shape: tuple[int, ...], raw: memoryview) -> Any:
    header = struct.pack(f"<BB{len(shape)}Q", dtype_index, len(shape), *shape)
    return msgspec.msgpack.Ext(kind, header + raw.tobytes())


def _unpack_array(data: memoryview, names: tuple[str, ...]) -> tuple[str, list[int], memoryview]:
    if len(data) < 2:
        raise ValueError("a tensor frame too short for its header")
    dtype_index, ndim = struct.unpack_from("<BB", data)
    if dtype_index >= len(names) or ndim > _MAX_DIMS or len(data) < 2 + 8 * ndim:
        raise ValueError("a tensor frame with a bad header")
    shape = list(struct.unpack_from(f"<{ndim}Q", data, 2))
    return names[dtype_index], shape, data[2 + 8 * ndim:]


def _encode_tensor(t: Any) -> Any:
    import torch

    name = str(t.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise TypeError(f"a {t.dtype} tensor cannot travel between processes")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else memoryview(b"")
    return _pack_array(_TENSOR, _TORCH_DTYPES.index(name), tuple(t.shape), memoryview(raw))


def _decode_tensor(data: memoryview) -> Any:
    import torch

    name, shape, raw = _unpack_array(data, _TORCH_DTYPES)
    dtype = getattr(torch, name)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ValueError("a tensor frame whose size does not match its shape")
    if not len(raw):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _encode_ndarray(a: Any) -> Any:
    import numpy as np

    name = a.dtype.name
    if name not in _NUMPY_DTYPES:
        raise TypeError(f"a {a.dtype} array cannot travel between processes")
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return _pack_array(_NDARRAY, _NUMPY_DTYPES.index(name), a.shape, memoryview(raw))


def _decode_ndarray(data: memoryview) -> Any:
    import numpy as np

    name, shape, raw = _unpack_array(data, _NUMPY_DTYPES)
    dtype = np.dtype(name)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ValueError("an array frame whose size does not match its shape")
    return np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _enc_hook(obj: Any) -> Any:
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _encode_tensor(obj)
    if np is not None and isinstance(obj, np.ndarray):
        return _encode_ndarray(obj)
    if isinstance(obj, RpcName):
        return msgspec.msgpack.Ext(_RPC, obj.name.encode())
    if callable(obj) and getattr(obj, "__qualname__", None):
        name = rpc_name(obj)
        if _RPC_FUNCTIONS.get(name) is not obj:
            raise TypeError(f"{name} is not a registered RPC function: decorate it with "
                            "@rpc_function (ingot.distributed.wire) at module level, or call a "
                            "Worker method by name")
        return msgspec.msgpack.Ext(_RPC, name.encode())
    raise TypeError(f"a {type(obj).__name__} cannot travel between processes (plain data, "
                    "tensors and arrays can)")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _TENSOR:
        return _decode_tensor(data)
    if code == _NDARRAY:
        return _decode_ndarray(data)
    if code == _RPC:
        return RpcName(bytes(data).decode())
    raise ValueError(f"unknown msgpack extension {code}")


def _dec_hook(tp: type, obj: Any) -> Any:
    # Tensors and arrays arrive as extensions (already rebuilt); a declared field only checks.
    if isinstance(obj, tp):
        return obj
    raise TypeError(f"expected {tp.__name__}, got {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_HEADER = msgspec.msgpack.Decoder(tuple[int, str])
_MAC_BYTES = 32


def encode(value: Any) -> bytes:
    return _ENCODER.encode(value)


def decoder(tp: Any) -> msgspec.msgpack.Decoder:
    """A decoder of ``tp`` (Any: plain data, tensors and arrays), the codec's hooks included."""
    return msgspec.msgpack.Decoder(tp, dec_hook=_dec_hook, ext_hook=_ext_hook)


def convert(value: Any, tp: Any) -> Any:
    """Plain decoded data (``Any``) as ``tp``, checked as a typed decode would."""
    return msgspec.convert(value, tp, dec_hook=_dec_hook)


# ---- a spawned child's link -------------------------------------------------------------

# What any spawned child may send, besides its user's kinds: connected (still starting), another
# node's heartbeat for it, gone (a traceback).
HELLO, ALIVE, FAILED = "hello", "alive", "failed"
CHILD_KINDS: dict[str, Any] = {HELLO: None, ALIVE: None, FAILED: str}


@dataclass(frozen=True)
class ChildLink:
    """How a child reaches its parent (part of its spawn arguments): where to receive calls and
    send replies, the launch's key, the parent to watch, the log level, and the modules whose
    RPC functions it may import (its parent's registry)."""

    in_addr: str
    out_addr: str
    key: bytes = field(repr=False)
    parent_pid: int
    log_level: int
    rpc_modules: tuple[str, ...] = ()



# ---- frames ----------------------------------------------------------------------------------


class Link:
    """One process's end of the sockets to its peers, under one key: ``seal`` frames what it
    sends (as sender ``index``), ``open`` checks and decodes what it receives against
    ``schema`` (kind -> type; None: the kind carries nothing)."""

    def __init__(self, key: bytes, schema: Mapping[str, Any], index: int = -1) -> None:
        self.key = key
        self.index = index
        self._decoders = {kind: decoder(tp) for kind, tp in schema.items()}
        self._headers: dict[str, bytes] = {}  # len(header) | header, by kind
        self._senders: dict[bytes, tuple[int, str]] = {}  # decoded headers
        self._dropped = 0
        self._logged_at = -math.inf

    def seal(self, kind: str, value: Any = None) -> bytes:
        """``value`` framed as ``kind``; TypeError when it cannot travel."""
        header = self._headers.get(kind)
        if header is None:
            packed = encode((self.index, kind))
            header = self._headers[kind] = bytes([len(packed)]) + packed
        signed = header + _ENCODER.encode(value)
        # hmac.digest: OpenSSL's one-shot HMAC, without hmac.HMAC's Python-level object.
        return hmac.digest(self.key, signed, "sha256") + signed

    def open(self, frame: bytes) -> tuple[int, str, Any] | None:
        """(sender index, kind, value), or None for a frame that was dropped."""
        signed = memoryview(frame)[_MAC_BYTES:]
        if not signed or len(signed) < 1 + signed[0]:
            return self._drop(f"{len(frame)} bytes is too short for a frame")
        if not hmac.compare_digest(frame[:_MAC_BYTES], hmac.digest(self.key, signed, "sha256")):
            return self._drop("it failed the HMAC check (sent without this launch's secret)")
        end = 1 + signed[0]
        header = bytes(signed[:end])
        known = self._senders.get(header)
        if known is None:  # authentic: one of the few (sender, kind) pairs of this link
            known = self._senders[header] = _HEADER.decode(signed[1:end])
        index, kind = known
        dec = self._decoders.get(kind)
        if dec is None:  # authentic, so one of ours out of step with this end: say so
            return self._drop(f"its kind {kind!r} is not one this end receives")
        return index, kind, dec.decode(signed[end:])

    def _drop(self, why: str) -> None:
        self._dropped += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            logger.warning("dropped a frame on an ingot process socket: %s (%d dropped so far)",
                           why, self._dropped)
            self._logged_at = now
        return None


def _curve_keys(key: bytes, role: bytes) -> tuple[bytes, bytes]:
    """A CURVE key pair (public, secret; Z85) derived from the launch's secret."""
    secret = z85.encode(hmac.digest(key, b"ingot curve " + role, "sha256"))
    return zmq.curve_public(secret), secret


def bind(ctx: zmq.Context, socket_type: int, addr: str, key: bytes) -> zmq.Socket:
    """A socket bound at ``addr``; over TCP, a CURVE server only peers with the secret reach."""
    sock = ctx.socket(socket_type)
    if addr.startswith("tcp://"):
        sock.curve_publickey, sock.curve_secretkey = _curve_keys(key, b"server")
        sock.curve_server = True
    try:
        sock.bind(addr)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def connect(ctx: zmq.Context, socket_type: int, addr: str, key: bytes) -> zmq.Socket:
    """A socket connected to ``addr`` (``bind``'s peer)."""
    sock = ctx.socket(socket_type)
    if addr.startswith("tcp://"):
        sock.curve_serverkey = _curve_keys(key, b"server")[0]
        sock.curve_publickey, sock.curve_secretkey = _curve_keys(key, b"client")
    sock.connect(addr)
    return sock
