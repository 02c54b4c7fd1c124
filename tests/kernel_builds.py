"""The builds of ingot's CPU kernels a test runs: every build of the bf16 library
(:data:`cpu_kernels.ISAS`), of the float32 library (:data:`cpu_kernels.F32_ISAS`) and of the
GGUF-quantized library (:data:`cpu_kernels.QUANT_ISAS`) that this CPU runs, so an AVX-512 machine tests its avx512_bf16, avx512, avx2 and portable builds, an AVX2
machine its avx2 and portable builds. Builds the CPU cannot run are not parametrized at all;
``test_build_runs_here`` (test_cpu_kernels.py) reports each of them once, with the number of
kernel tests that did not run for it, counted at collection (tests/conftest.py calls
:func:`count`).

A test takes a build with ``@pytest.mark.parametrize("isa", over("bf16"))`` (or a fixture with
``params=over("bf16")``) and loads it with :func:`load`."""

from __future__ import annotations

from collections import Counter

import pytest

from ingot.model_executor.layers import cpu_kernels

# Read once, at collection, from the real /proc/cpuinfo (before any test fakes the flags).
#: Each library's builds, widest first, and those of them this CPU runs.
LIBRARIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "bf16": (tuple(cpu_kernels.ISAS), cpu_kernels.cpu_isas()),
    "f32": (cpu_kernels.F32_ISAS, cpu_kernels.f32_isas()),
    # (and, on a CPU with VNNI, its builds without it: the integer dots other CPUs run)
    "quant": (cpu_kernels.QUANT_ISAS, cpu_kernels.quant_builds_here()),
}
_NAMES = {"bf16": "bf16", "f32": "float32", "quant": "quantized"}
_LOADERS = {"bf16": cpu_kernels.load_cpu_kernels, "f32": cpu_kernels.load_f32_kernels,
            "quant": cpu_kernels.load_quant_kernels}
# The conftest markers that skip a test where the library does not build at all (no compiler).
_NEEDS = {"bf16": pytest.mark.needs_kernels, "f32": pytest.mark.needs_f32_kernels,
          "quant": pytest.mark.needs_quant_kernels}

#: Kernel tests collected per (library, build): filled by :func:`count`.
collected: Counter[tuple[str, str]] = Counter()


def runs(isa: str) -> bool:
    """Whether this CPU runs ``isa`` (a build of either library)."""
    return isa in LIBRARIES["bf16"][1]


def over(library: str) -> list:
    """``library``'s builds this CPU runs, as parameters: each marked ``kernel_build`` (counted
    by :func:`count`) and with the library's ``needs_*kernels`` marker."""
    return [
        pytest.param(isa, id=isa,
                     marks=[pytest.mark.kernel_build(library, isa), _NEEDS[library]])
        for isa in LIBRARIES[library][1]
    ]


def every_build() -> list:
    """Every build of either library, run here or not (``test_build_runs_here``): one this CPU
    runs with the ``needs_*kernels`` markers of the libraries it is a build of."""
    return [
        pytest.param(isa, id=isa, marks=[_NEEDS[library] for library, (builds, _) in
                                         LIBRARIES.items() if isa in builds] if runs(isa) else [])
        for isa in LIBRARIES["bf16"][0]
    ]


def load(library: str, isa: str):  # noqa: ANN201
    """``library``'s ``isa`` build. The CPU runs it (:func:`over` gives no other) and the
    library builds here (the ``needs_*kernels`` marker skipped the test otherwise), so a build
    that does not load is a failure, not a skip."""
    kernels = _LOADERS[library](isa)
    assert kernels is not None, (
        f"the {isa} build of ingot's {_NAMES[library]} kernels did not load on a CPU that runs "
        "it (see the warning logged by cpu_kernels)")
    return kernels


def count(items: list[pytest.Item]) -> None:
    """Counts the collected kernel tests of each build (conftest's collection hook)."""
    collected.clear()
    for item in items:
        for marker in item.iter_markers("kernel_build"):
            collected[marker.args] += 1


def missing_flags(isa: str) -> list[str]:
    """The /proc/cpuinfo flags ``isa`` needs that this CPU lacks."""
    return [flag for flag in cpu_kernels.ISAS[isa].cpu_flags if not cpu_kernels._cpu_has(flag)]


def not_run(isa: str) -> str:
    """Why the kernel tests of ``isa`` (a build this CPU cannot run) did not run, and how many:
    per library it is a build of, as many as a build this CPU runs got in this collection."""
    per_library = {
        library: max((collected[(library, run)] for run in runnable), default=0)
        for library, (builds, runnable) in LIBRARIES.items() if isa in builds
    }
    total = sum(per_library.values())
    head = (f"this CPU does not run the {isa} build of ingot's kernels "
            f"({', '.join(missing_flags(isa))} missing)")
    if total == 0:
        return f"{head}: none of its kernel tests were collected in this run"
    detail = " + ".join(f"{n} {_NAMES[library]}" for library, n in per_library.items() if n)
    if len(per_library) > 1:
        return f"{head}: its {total} kernel tests ({detail}) did not run here"
    return f"{head}: its {total} kernel tests did not run here"
