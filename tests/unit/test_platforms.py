"""Platform plugins: built-ins, resolution rules, and out-of-tree plugins via real entry points."""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import ingot.platforms.cpu as cpu_mod
from ingot.platforms import (
    BUILTIN_PLATFORM_PLUGINS,
    cpu_platform_plugin,
    cuda_platform_plugin,
    discover_platform_plugins,
    resolve_platform,
)
from ingot.platforms.cpu import CpuPlatform
from ingot.platforms.cuda import CudaPlatform
from ingot.platforms.interface import Platform


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # Deterministic on GPU machines too.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


FakeInstaller = Callable[..., None]


@pytest.fixture
def install_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeInstaller]:
    """Write ``<module>.py`` plus a ``<module>-0.1.dist-info`` registering it as a plugin."""
    monkeypatch.syspath_prepend(str(tmp_path))
    modules: list[str] = []

    def install(
        module: str,
        ep_name: str,
        *,
        body: str = "return f'{__name__}.FakePlatform'",
        ep: str | None = None,
    ) -> None:
        (tmp_path / f"{module}.py").write_text(
            textwrap.dedent(
                f"""\
                from ingot.platforms.interface import Platform

                class FakePlatform(Platform):
                    name = {ep_name!r}
                    device_type = "cpu"

                    @classmethod
                    def is_available(cls):
                        return True

                def plugin():
                    {body}
                """
            )
        )
        dist_info = tmp_path / f"{module}-0.1.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n"
        )
        target = ep or f"{module}:plugin"
        (dist_info / "entry_points.txt").write_text(f"[ingot.platforms]\n{ep_name} = {target}\n")
        modules.append(module)
        importlib.invalidate_caches()

    yield install
    for module in modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


# --- built-ins ---------------------------------------------------------------------------------


def test_builtins_are_known_without_installation() -> None:
    plugins = discover_platform_plugins()
    assert plugins["cpu"] is cpu_platform_plugin
    assert plugins["cuda"] is cuda_platform_plugin
    assert set(BUILTIN_PLATFORM_PLUGINS) == {"cpu", "cuda"}


def test_auto_resolves_cpu_without_cuda(no_cuda: None) -> None:
    assert resolve_platform() is CpuPlatform
    assert resolve_platform("auto") is CpuPlatform


def test_auto_prefers_cuda_when_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_platform("auto") is CudaPlatform


def test_explicit_cpu() -> None:
    cls = resolve_platform("cpu")
    assert cls is CpuPlatform
    assert issubclass(cls, Platform)
    assert cls.name == "cpu" and cls.device_type == "cpu"
    assert cls.dist_backend == "gloo" and cls.compile_backend == "inductor"
    assert cls.is_available()
    assert cls.device() == torch.device("cpu") == torch.zeros(1).device


def test_cuda_class_attributes() -> None:
    assert CudaPlatform.dist_backend == "nccl"
    assert CudaPlatform.device(1) == torch.device("cuda", 1)


def test_unknown_device() -> None:
    with pytest.raises(ValueError, match=r"unknown device 'tpu'; available: .*cpu.*cuda"):
        resolve_platform("tpu")


def test_cuda_unavailable(no_cuda: None) -> None:
    assert cuda_platform_plugin() is None
    with pytest.raises(ValueError, match="device 'cuda' is not available on this machine"):
        resolve_platform("cuda")


# --- dtypes ------------------------------------------------------------------------------------


def test_check_dtype() -> None:
    assert CpuPlatform.check_dtype(torch.float32) is torch.float32
    assert CpuPlatform.check_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="dtype int8 is not supported on platform cpu; use one of"):
        CpuPlatform.check_dtype(torch.int8)


def test_cpu_default_dtype_follows_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    # This CPU: bf16 exactly where it computes bf16 natively (the faked flags below pin the
    # flags that mean it).
    native = CpuPlatform.supports_bf16()
    assert CpuPlatform.default_dtype() is (torch.bfloat16 if native else torch.float32)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(cpu_mod, "_cpu_flags", lambda: frozenset({"sse2", "avx512_bf16"}))
    assert CpuPlatform.default_dtype() is torch.bfloat16
    monkeypatch.setattr(cpu_mod, "_cpu_flags", lambda: frozenset({"sse2", "avx2"}))
    assert CpuPlatform.default_dtype() is torch.float32


def test_cpu_prefill_only_dtype_is_bf16_only_with_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder's auto dtype: float32 unless AMX makes bf16 matmuls faster; the decoder
    default (bf16 with AVX512-BF16) is unchanged."""
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(cpu_mod, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert CpuPlatform.prefill_only_dtype() is torch.float32
    assert CpuPlatform.default_dtype() is torch.bfloat16
    monkeypatch.setattr(cpu_mod, "_cpu_flags",
                        lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    assert CpuPlatform.prefill_only_dtype() is torch.bfloat16
    monkeypatch.setattr(cpu_mod, "_cpu_flags", lambda: frozenset({"sse2", "amx_bf16"}))
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert CpuPlatform.prefill_only_dtype() is torch.float32


def test_cpu_flags_unreadable_means_fp32(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu_mod._cpu_flags.cache_clear()
    monkeypatch.setattr(cpu_mod, "_CPUINFO", str(tmp_path / "missing"))
    try:
        assert cpu_mod._cpu_flags() == frozenset()
        assert CpuPlatform.default_dtype() is torch.float32
    finally:
        cpu_mod._cpu_flags.cache_clear()


def test_cuda_rejects_bf16_without_hardware_support(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert CudaPlatform.default_dtype() is torch.float32
    with pytest.raises(ValueError, match="bfloat16 is not supported on platform cuda"):
        CudaPlatform.check_dtype(torch.bfloat16)
    assert CudaPlatform.check_dtype(torch.float16) is torch.float16


# --- memory, seeding ---------------------------------------------------------------------------


def test_cpu_memory_numbers() -> None:
    total = CpuPlatform.total_memory_bytes()
    available = CpuPlatform.available_memory_bytes(CpuPlatform.device())
    assert 0 < available <= total


def test_cpu_memory_falls_back_to_sysconf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_mod, "_MEMINFO", str(tmp_path / "missing"))
    total = CpuPlatform.total_memory_bytes()
    available = CpuPlatform.available_memory_bytes()
    assert 0 < available <= total


def test_seed_everything_is_reproducible() -> None:
    CpuPlatform.seed_everything(1234)
    a = torch.rand(4)
    CpuPlatform.seed_everything(1234)
    assert torch.equal(a, torch.rand(4))


# --- out-of-tree plugins through real entry-point metadata --------------------------------------


def test_fake_plugin_via_entry_points(install_fake: FakeInstaller, no_cuda: None) -> None:
    install_fake("fake_ingot_platform", "fake")
    assert "fake" in discover_platform_plugins()

    auto = resolve_platform("auto")
    assert auto.__module__ == "fake_ingot_platform" and auto.__name__ == "FakePlatform"
    assert issubclass(auto, Platform)
    assert resolve_platform("fake") is auto
    assert resolve_platform("cpu") is CpuPlatform  # explicit built-ins still work

    install_fake("fake_ingot_platform2", "fake2")
    with pytest.raises(ValueError, match="fake, fake2.*--device NAME"):
        resolve_platform("auto")
    assert resolve_platform("fake2").__module__ == "fake_ingot_platform2"


def test_inactive_plugin_falls_back(install_fake: FakeInstaller, no_cuda: None) -> None:
    install_fake("fake_ingot_inactive", "inactive", body="return None")
    assert resolve_platform("auto") is CpuPlatform
    with pytest.raises(ValueError, match="device 'inactive' is not available"):
        resolve_platform("inactive")


def test_raising_plugin_is_unavailable(
    install_fake: FakeInstaller, no_cuda: None, caplog: pytest.LogCaptureFixture
) -> None:
    install_fake("fake_ingot_broken", "broken", body="raise RuntimeError('driver missing')")
    with caplog.at_level(logging.WARNING, logger="ingot"):
        assert resolve_platform("auto") is CpuPlatform
    assert "driver missing" in caplog.text
    with pytest.raises(ValueError, match="device 'broken' is not available"):
        resolve_platform("broken")


def test_plugin_cannot_take_over_builtin_name(
    install_fake: FakeInstaller, caplog: pytest.LogCaptureFixture
) -> None:
    install_fake("fake_ingot_usurper", "cpu")
    with caplog.at_level(logging.WARNING, logger="ingot"):
        assert discover_platform_plugins()["cpu"] is cpu_platform_plugin
    assert "fake_ingot_usurper:plugin" in caplog.text and "built-in" in caplog.text


def test_own_entry_points_are_not_duplicates(
    install_fake: FakeInstaller, caplog: pytest.LogCaptureFixture
) -> None:
    # What an installed ingot registers: identical to the built-ins, so no warning.
    install_fake("fake_ingot_self", "cpu", ep="ingot.platforms:cpu_platform_plugin")
    with caplog.at_level(logging.WARNING, logger="ingot"):
        assert discover_platform_plugins()["cpu"] is cpu_platform_plugin
    assert caplog.text == ""
