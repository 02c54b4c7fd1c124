"""Regional compilation of the decoder layers, the bucket warmup, and the persistent cache.

* **Compile unit:** one decoder layer's forward. All layers run the same code on tensors of the
  same shapes, and Dynamo lifts their weights as graph inputs, so the N layers share one compiled
  graph per bucket (the backend is called once per bucket, not once per layer). Embedding, final
  norm, logits and sampler stay eager.
* **Shapes:** every bucket dimension is specialised (no automatic dynamic shapes); only the KV
  cache's block count is dynamic, because it follows the memory budget and would otherwise make
  the graphs (and the cache) differ from one start to the next.
* **Warmup:** runs the model once per distinct bucket shape on the runner's dummy steps
  (``DummySteps.dummy_step``, built by ``ModelRunner.prepare_inputs`` itself, so the warmup sees
  exactly the inputs serving will), before the engine reports ready.
* **Precompiled buckets:** each bucket is compiled ahead of time with Dynamo's precompile
  (``aot_compile``: the traced bytecode, its guards and Inductor's output, serialisable) from
  example inputs of its shape, and saved as one file. A warm start loads those files instead of
  re-tracing every graph with Dynamo (which cost ~1 s a bucket, most of a warm start), and a
  layer call picks its bucket's function by shape (its guards still checked). A shape outside
  the table goes through ``torch.compile`` as usual, so it is traced, compiled and counted. FP8
  caches (whose per-layer scales are baked into the graphs) and a torch without precompile use
  the traced warmup instead.
* **Persistence:** Inductor's own FX graph and AOTAutograd caches live under
  ``$INGOT_CACHE_ROOT/inductor``. On top, one :class:`CompileCache` entry per (model, grid,
  toolchain) key holds the precompiled buckets (``aot/``), ``torch.compiler.save_cache_artifacts()``
  (the portable "mega-cache") and the CPU kernel binaries neither carries (on CPU they hold the
  C++ sources only, so a fresh host would rebuild every kernel). A hit loads them: zero
  compilations, zero traces.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ingot.compilation.backend import IngotBackend
from ingot.compilation.cache import CompileCache, private_dir
from ingot.compilation.cache_key import compute_cache_key
from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.worker.warmup import DummySteps, WarmupShape, warmup_shapes

if TYPE_CHECKING:
    from ingot.config import EngineConfig

logger = logging.getLogger("ingot")

MEGA_CACHE_FILE = "torch_cache_artifacts.bin"
KERNELS_DIR = "kernels"
MANIFEST_FILE = "manifest.json"
PRECOMPILED_DIR = "aot"

#: The model's forward over its modules (the compiled layers inside): hidden states.
ModelForward = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], Any]


def precompile_supported() -> bool:
    """Whether this torch can save and load Dynamo-precompiled functions (2.13 can; 2.11 loads
    but cannot ``aot_compile`` a ``torch.compile`` result)."""
    return (hasattr(torch.compiler, "load_compiled_function")
            and hasattr(torch.compile(_run_layer, backend="eager"), "aot_compile"))


@dataclass
class WarmupSummary:
    graphs: int
    compiled: int
    cache_hits: int
    compile_seconds: float
    seconds: float
    cache_result: str  # "hit" | "built" | "remote" | "off"
    key: str

    def line(self) -> str:
        return (f"compile warmup: {self.graphs} graphs, {self.cache_hits} hits, "
                f"{self.compiled} misses (compiled), compile cache {self.cache_result} "
                f"(key {self.key[:12]}), {self.seconds:.1f} s")


def _source_digest() -> str:
    """Digest of the code that defines the compiled graphs (model layers, passes, backend)."""
    import ingot

    root = Path(ingot.__file__).parent
    h = hashlib.sha256()
    paths = [p for sub in ("model_executor/layers", "model_executor/models", "compilation")
             for p in sorted((root / sub).rglob("*.py"))]
    for path in [*paths, Path(__file__)]:  # this file holds the compiled layer call
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def grid_cache_key(config: EngineConfig, shapes: list[WarmupShape], backend: IngotBackend,
                   precompile: bool = False) -> str:
    """The compile cache key of a whole warmup: model, dtypes, grid, code, options, platform,
    and whether the entry holds precompiled buckets."""
    hf = config.model_config.hf_config
    hf_doc = hf.to_json_string() if hasattr(hf, "to_json_string") else repr(hf)
    document = json.dumps({
        "hf_config": hf_doc,
        "dtype": str(config.model_config.dtype),
        "kv_cache_dtype": config.cache_config.kv_cache_dtype,
        "block_size": config.cache_config.block_size,
        "shapes": [s.label for s in shapes],
        "source": _source_digest(),
    }, sort_keys=True)
    options = {"enable_fx_passes": backend.enable_fx_passes, "dynamic": False,
               "unit": "decoder_layer", "lowering": "inductor", "precompiled": precompile}
    platform = config.device
    if config.device == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        platform = f"cuda:sm{major}{minor}"
    return compute_cache_key(document, [], options, platform, {"tensor_parallel_size": 1})


def _run_layer(layer: torch.nn.Module, positions: torch.Tensor, hidden: torch.Tensor,
               residual: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> Any:
    return type(layer).forward(layer, positions, hidden, residual, kv_cache, meta)


def _fresh_function(fn: types.FunctionType) -> types.FunctionType:
    # Dynamo keeps compiled code on the code object; a copy per engine keeps engines in one
    # process (tests, benchmarks) from sharing, or evicting, each other's graphs.
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def _configure_dynamo(num_shapes: int) -> None:
    import torch._dynamo.config as dynamo_config

    # Each bucket is one cache entry of the layer function; the default limit (8) would make
    # Dynamo fall back to eager for the rest of a large grid.
    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, num_shapes + 8)
    dynamo_config.accumulated_cache_size_limit = max(
        dynamo_config.accumulated_cache_size_limit, 4 * (num_shapes + 8))
    # Never turn a bucket dimension dynamic after seeing two buckets: graphs stay specialised.
    dynamo_config.automatic_dynamic_shapes = False


def configure_inductor_cache(cache_root: Path) -> Path:
    """Point Inductor's on-disk caches (FX graph, AOTAutograd, kernels) under ``cache_root``."""
    import torch._inductor.config as inductor_config

    # Inductor loads the .so files it finds here: the same owner check as the compile cache.
    inductor_dir = private_dir(cache_root / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    inductor_config.fx_graph_cache = True
    return inductor_dir


def _kernel_files(inductor_dir: Path, since: float) -> list[Path]:
    """The compiled C++ kernels the graphs of this process load (the mega-cache lacks them)."""
    from torch._inductor import codecache

    found: set[Path] = set()
    for name in ("CppPythonBindingsCodeCache", "CppCodeCache", "CppWrapperCodeCache"):
        for key in getattr(getattr(codecache, name, None), "cache", {}) or {}:
            if isinstance(key, str) and len(key) > 3:
                found.update((inductor_dir / key[1:3]).glob(f"{key}*"))
    # Whatever else was built during this warmup (in case the code caches above change).
    found.update(p for p in inductor_dir.glob("*/*.so") if p.stat().st_mtime >= since)
    return sorted(p for p in found if p.is_file())


def export_artifacts(entry: Path, inductor_dir: Path, since: float) -> None:
    """Write the portable artifacts of everything compiled so far into ``entry``."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is not None:
        (entry / MEGA_CACHE_FILE).write_bytes(saved[0])
    kernels = _kernel_files(inductor_dir, since)
    for path in kernels:
        dest = entry / KERNELS_DIR / path.relative_to(inductor_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    (entry / MANIFEST_FILE).write_text(json.dumps({
        "torch": torch.__version__, "mega_cache": saved is not None, "kernels": len(kernels)}))


def import_artifacts(entry: Path, inductor_dir: Path) -> None:
    """Load an entry into this process's Inductor caches."""
    mega = entry / MEGA_CACHE_FILE
    if mega.exists():
        torch.compiler.load_cache_artifacts(mega.read_bytes())
    kernels = entry / KERNELS_DIR
    if kernels.is_dir():
        for path in kernels.rglob("*"):
            dest = inductor_dir / path.relative_to(kernels)
            if path.is_file() and not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
                shutil.copy2(path, tmp)
                os.replace(tmp, dest)  # atomic: a concurrent loader never sees half a .so


class ModelCompiler:
    """Compiles a model's decoder layers for every bucket of the grid, through the compile
    cache. It knows the layers and the device; the dummy steps it warms up with and the
    model's forward are handed to :meth:`compile_and_warmup`.

    Args:
        config: the engine config (its ``compilation`` part says where the cache is).
        layers: the decoder layers (compiled in place: each gets a dispatching forward).
        device: where the model runs.
        progress: show a tqdm bar (stderr) while warming up.
    """

    def __init__(self, config: EngineConfig, layers: nn.ModuleList, device: torch.device,
                 progress: bool = True) -> None:
        cc = config.compilation
        if not config.buckets.enabled:
            raise ValueError("compilation needs static shapes: enable_bucketing must be on "
                             "(or pass --enforce-eager)")
        self.config = config
        self.layers = layers
        self.device = device
        self.progress = progress
        self.cache = CompileCache(root=cc.cache_root, hit_only=cc.hit_only)
        self.inductor_dir = configure_inductor_cache(self.cache.dir.parent)
        self.backend = IngotBackend(device.type, cc.enable_fx_passes,
                                    hit_only=self.cache.hit_only)
        self.shapes = warmup_shapes(config)
        # FP8 scales differ per layer and are graph constants: layer 0's graphs would not serve
        # the others, so FP8 caches keep the traced warmup (which runs every layer).
        self.precompile = (precompile_supported()
                           and not config.cache_config.kv_cache_dtype.startswith("fp8"))
        self.key = grid_cache_key(config, self.shapes, self.backend, self.precompile)
        self.summary: WarmupSummary | None = None
        #: Precompiled function per bucket signature (num_tokens, num_reqs, width).
        self.functions: dict[tuple[int, int, int], Any] = {}
        #: The autograd-free mode of tracing and serving. Precompiled guards are restored
        #: expecting ordinary tensors (torch 2.13 does not keep inference-mode dispatch keys):
        #: trace and serve without inference mode.
        self.grad_mode: Callable[[], AbstractContextManager[Any]] = (
            torch.no_grad if self.precompile else torch.inference_mode)
        _configure_dynamo(len(self.shapes))
        self._install()

    def _install(self) -> None:
        from ingot.model_executor.layers.linear import LinearBase

        layers = self.layers
        for module in layers.modules():
            if isinstance(module, LinearBase):
                # Dynamo cannot trace oneDNN's opaque pre-packed weights (nor ingot's kernels):
                # compiled layers use the plain weight (the eager head and embedding keep
                # their packing).
                if module.weight.numel() == 0:
                    raise RuntimeError(
                        "a linear's plain weight was released when its packed copy was made; "
                        "bind the model with keep_plain (compilation enabled) to compile it")
                module.packed_weight = module.gemv_weight = module.gemm_weight = None
            if getattr(module, "cpu_kernels", None) is not None:
                module.cpu_kernels = None  # ctypes kernels are opaque to Dynamo too
        compiled = torch.compile(_fresh_function(_run_layer), backend=self.backend,
                                 fullgraph=True, dynamic=None)
        self.compiled = compiled
        functions = self.functions
        for layer in layers:
            def forward(positions: torch.Tensor, hidden: torch.Tensor,
                        residual: torch.Tensor | None, kv_cache: torch.Tensor, meta: Any,
                        _layer: torch.nn.Module = layer) -> Any:
                if residual is None:
                    # The first layer gets residual = 0 (x + 0 == x exactly), so it runs the
                    # same graph as every other layer instead of a second one.
                    residual = torch.zeros_like(hidden)
                args = (_layer, positions, hidden, residual, kv_cache, meta)
                fn = functions.get((hidden.shape[0], meta.num_reqs, meta.block_table.shape[1]))
                if fn is not None and fn.guard_check(*args):
                    return fn(*args)
                return compiled(*args)

            layer.forward = forward

    def _mark_kv_dynamic(self, kv_caches: list[torch.Tensor]) -> None:
        """Before tracing: the block count follows the memory budget, so it stays symbolic in
        the graphs (and out of the keys). Loaded precompiled functions expect unmarked caches
        (the marking is a tensor attribute their restored guards check for), so a warm start
        does not call this."""
        for kv_cache in kv_caches:
            torch._dynamo.mark_dynamic(kv_cache, 1)

    def _warmup(self, steps: DummySteps, forward: ModelForward) -> None:
        from tqdm import tqdm

        bar = tqdm(self.shapes, desc="compiling buckets", unit="graph", disable=not self.progress,
                   leave=False)
        # The serving mode (grad_mode): the traced guards must see the tensors serving will.
        with self.grad_mode():
            for shape in bar:
                bar.set_postfix_str(shape.label)
                self.backend.label = shape.label
                input_ids, positions, meta = steps.dummy_step(shape)
                forward(input_ids, positions, steps.kv_caches, meta)
        bar.close()
        self.backend.label = "serving"
        steps.forget_dummy_steps()

    def _example_inputs(self, steps: DummySteps, shape: WarmupShape) -> tuple[Any, ...]:
        """Layer-0 arguments of this bucket's shape (what the warmup's first layer would get)."""
        _, positions, meta = steps.dummy_step(shape)
        hf = self.config.model_config.hf_config
        hidden = torch.zeros(shape.num_tokens, hf.hidden_size,
                             dtype=self.config.model_config.dtype, device=self.device)
        return (self.layers[0], positions, hidden, torch.zeros_like(hidden),
                steps.kv_caches[0], meta)

    def _precompile(self, steps: DummySteps, entry: Path) -> None:
        """Trace and compile every bucket ahead of time into ``entry/aot/<label>.bin``."""
        from tqdm import tqdm

        directory = entry / PRECOMPILED_DIR
        directory.mkdir(exist_ok=True)
        bar = tqdm(self.shapes, desc="compiling buckets", unit="graph", disable=not self.progress,
                   leave=False)
        # The saved guards pickle the example layer's state; its dispatching forward (an
        # instance attribute, see _install) reaches the functions compiled so far, whose guard
        # managers cannot be pickled. The compiled code never calls it: set it aside meanwhile.
        layer = self.layers[0]
        dispatch = layer.__dict__.pop("forward")
        try:
            with self.grad_mode():
                for shape in bar:
                    bar.set_postfix_str(shape.label)
                    self.backend.label = shape.label
                    fn = self.compiled.aot_compile((self._example_inputs(steps, shape), {}))
                    fn.save_compiled_function(str(directory / f"{shape.label}.bin"))
                    self._use(shape, fn)
        finally:
            layer.forward = dispatch
        bar.close()
        self.backend.label = "serving"

    def _load_precompiled(self, entry: Path) -> bool:
        """Load every bucket's precompiled function; False if the entry has none."""
        directory = entry / PRECOMPILED_DIR
        if not directory.is_dir():
            return False
        for shape in self.shapes:
            with open(directory / f"{shape.label}.bin", "rb") as f:
                self._use(shape, torch.compiler.load_compiled_function(f))
        self.backend.stats.cache_hits += len(self.shapes)
        return True

    def _use(self, shape: WarmupShape, fn: Any) -> None:
        fn.disable_guard_check()  # the layer forward checks them once before calling
        self.functions[shape.signature] = fn

    def compile_and_warmup(self, steps: DummySteps, forward: ModelForward) -> WarmupSummary:
        """Compile (or load) every bucket's graph, running ``forward`` (the model over its
        modules) on ``steps``' dummy steps where a bucket is traced; returns the one-line
        summary's figures."""
        start = time.perf_counter()
        built = False

        def build(entry: Path) -> None:
            nonlocal built
            since = time.time() - 1
            self._mark_kv_dynamic(steps.kv_caches)
            if self.precompile:
                self._precompile(steps, entry)
            else:
                self._warmup(steps, forward)
            built = True
            export_artifacts(entry, self.inductor_dir, since)

        def load(entry: Path) -> str:
            if not built:
                import_artifacts(entry, self.inductor_dir)
                if self.precompile:
                    self._load_precompiled(entry)
            return "built" if built else "hit"

        stats_before = self.cache.stats.remote_hits
        result = self.cache.get_or_create(self.key, build, load, label="grid")
        if self.cache.stats.remote_hits > stats_before:
            result = "remote"
        if not built and not self.functions:
            self._mark_kv_dynamic(steps.kv_caches)
            self._warmup(steps, forward)  # traced warmup, served from Inductor's caches
        self.backend.warmed_up = True
        s = self.backend.stats
        self.summary = WarmupSummary(
            graphs=len(self.shapes), compiled=s.compilations, cache_hits=s.cache_hits,
            compile_seconds=s.total_compile_seconds, seconds=time.perf_counter() - start,
            cache_result=result, key=self.key)
        logger.info("%s", self.summary.line())
        for label, seconds in s.compile_seconds.items():
            logger.debug("compile seconds %s: %.2f", label, seconds)
        return self.summary
