"""``--cpu-limit``: run a benchmark process inside a CPU limit, so "a process limited to one
CPU" (issue #21) is measured the way users meet it: a CPU affinity mask (``taskset:0``, what
``taskset -c 0`` gives) or a CFS quota (``cgroup:1``, what a container with ``--cpus 1`` gives:
every core visible, one CPU's worth of time per period). Both engines get the same limit; the
command's children (engine-core and worker processes) inherit it.

The cgroup is created under the cgroup v2 root or the v1 ``cpu`` controller, and removed
afterwards; creating one needs write access there (root in a VM or a privileged container)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

CGROUP_ROOT = "/sys/fs/cgroup"
PERIOD_US = 100_000


@dataclass(frozen=True)
class CpuLimit:
    kind: str  # "taskset" or "cgroup"
    cpus: str = ""  # taskset: a CPU list as taskset -c takes it ("0", "0-1", "0,2")
    quota: float = 0.0  # cgroup: CPUs' worth of time per period

    def describe(self) -> str:
        if self.kind == "taskset":
            return f"`taskset -c {self.cpus}`"
        return f"a cgroup with a CPU quota of {self.quota:g} CPU (CFS, every core visible)"


def parse_cpu_limit(spec: str) -> CpuLimit:
    """``taskset:LIST`` or ``cgroup:CPUS``; anything else is a ValueError saying the forms."""
    kind, sep, value = spec.partition(":")
    forms = "use taskset:CPU-LIST (e.g. taskset:0) or cgroup:CPUS (e.g. cgroup:1)"
    if not sep or not value:
        raise ValueError(f"--cpu-limit {spec!r}: {forms}")
    if kind == "taskset":
        parts = value.replace("-", ",").split(",")
        if not all(p.isdigit() for p in parts):
            raise ValueError(f"--cpu-limit {spec!r}: {value!r} is not a CPU list; {forms}")
        return CpuLimit("taskset", cpus=value)
    if kind == "cgroup":
        try:
            quota = float(value)
        except ValueError:
            raise ValueError(f"--cpu-limit {spec!r}: {value!r} is not a number of CPUs; "
                             f"{forms}") from None
        if not 0.01 <= quota <= (os.cpu_count() or 1):
            raise ValueError(f"--cpu-limit {spec!r}: the quota must be between 0.01 and "
                             f"{os.cpu_count()} CPUs")
        return CpuLimit("cgroup", quota=quota)
    raise ValueError(f"--cpu-limit {spec!r}: unknown kind {kind!r}; {forms}")


def _cgroup_dir(root: str) -> tuple[str, bool]:
    """Where to create the cgroup, and whether it is cgroup v2."""
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        return root, True
    v1 = os.path.join(root, "cpu")
    if os.path.isdir(v1):
        return v1, False
    raise OSError(f"no cgroup v2 root or v1 cpu controller under {root}")


@contextlib.contextmanager
def cpu_limited(limit: CpuLimit, root: str = CGROUP_ROOT) -> Iterator[list[str]]:
    """An argv prefix that runs a command inside ``limit`` (the cgroup exists until exit)."""
    if limit.kind == "taskset":
        if shutil.which("taskset") is None:
            raise OSError("taskset is not installed (util-linux)")
        yield ["taskset", "-c", limit.cpus]
        return
    parent, v2 = _cgroup_dir(root)
    path = os.path.join(parent, f"ingot-bench-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    try:
        quota_us = max(1000, round(limit.quota * PERIOD_US))
        if v2:
            with open(os.path.join(path, "cpu.max"), "w") as f:
                f.write(f"{quota_us} {PERIOD_US}")
        else:
            with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
                f.write(str(PERIOD_US))
            with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(quota_us))
        procs = os.path.join(path, "cgroup.procs")
        # The shell moves itself into the cgroup, then becomes the command.
        yield ["sh", "-c", f'echo $$ > {shlex.quote(procs)} && exec "$@"', "cpu-limited"]
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(path)  # fails while a process is still inside; left then, harmless
