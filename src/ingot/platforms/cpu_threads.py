"""How many OpenMP compute threads ingot runs on the CPU, on which CPUs, and when it runs fewer.

Why this exists: every decode op is one OpenMP parallel region (about 150 per token for the
default model), and each region ends in a barrier that waits for its slowest thread. With one
thread per core and one other busy process on the machine, one of ingot's threads shares a core
and is descheduled for whole scheduler slices, so every region waits for it: measured on the
2-core project VM, single-stream decode fell from ~82 to ~20 tok/s, while one thread, which
owns a core outright, kept ~42.

So the policy is:

* **Start-up** (:func:`plan_threads`): the thread count comes from what this process may
  actually use -- its affinity mask (``taskset``, ``--cpuset-cpus``) and its cgroup CPU quota
  (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``; 1.5 CPUs -> 1 thread, since a second
  spinning thread could only run on borrowed time) -- unless the user sets it with
  ``--cpu-threads`` / ``--cpu-threads-bind``, vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` or
  ``OMP_NUM_THREADS``. The choice and its reason are logged.
* **While running** (:class:`AdaptiveThreads`): when other processes use our CPUs (from
  ``/proc/stat``), or steps get much slower than their own recent median for the same shape,
  try one thread fewer for a few steps and keep it if it is faster; try one more when the
  machine is quiet again. Each switch is logged; the count is the
  ``ingot:cpu_compute_threads`` metric. The count never exceeds the start-up plan.

The OpenMP master thread is the worker's compute thread (worker/executor.py, ComputeThread), the
only thread that runs model ops: the engine thread's scheduling and detokenizing is small next
to a step, so no core is kept back for the engine loop the way vLLM's separate engine process
needs one; see docs/PERFORMANCE.md for the measurement behind that default.

ingot's C kernels take ``torch.get_num_threads()`` as their team size and oneDNN reads the
same OpenMP setting, so ``torch.set_num_threads`` is the one switch for all three.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger("ingot")

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
PROC_STAT = "/proc/stat"
PROC_SELF_STAT = "/proc/self/stat"

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
T = TypeVar("T")


# ---- what the process may use ------------------------------------------------------------


def parse_cpu_list(text: str, what: str) -> list[int]:
    """``"0-1"``, ``"0,2"``, ``"5,2-4"`` -> CPU ids in the order given (ranges ascending).

    ``what`` names the setting in the error, so the message says what to change."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise ValueError(
                f"{what}={text!r} is not a CPU list; use ids and ranges such as 0-1 or 0,2"
            ) from None
        if first < 0 or last < first:
            raise ValueError(f"{what}={text!r}: the range {part!r} is empty or negative; "
                             "write ranges low-high, such as 0-3")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{what}={text!r} names a CPU twice; list each CPU once")
    return cpus


def rank_bind_lists(text: str, ranks: int, what: str) -> list[str]:
    """vLLM's per-rank form ``"0-1|2-3"``: rank i's CPU list (or ``auto`` / ``nobind``) is
    the i-th ``|``-separated part. There must be one part per rank, and no CPU in two ranks'
    lists: two ranks' threads on one CPU would wait for each other at every op."""
    parts = [p.strip() for p in text.split("|")]
    if len(parts) != ranks:
        raise ValueError(f"{what}={text!r} has {len(parts)} parts for {ranks} ranks; give "
                         "one list per rank, separated by '|'")
    owner: dict[int, int] = {}
    for rank, part in enumerate(parts):
        if part in ("auto", "nobind", ""):
            continue
        for cpu in parse_cpu_list(part, what):
            if cpu in owner:
                raise ValueError(f"{what}={text!r}: CPU {cpu} is in the lists of ranks "
                                 f"{owner[cpu]} and {rank}; give each rank its own CPUs")
            owner[cpu] = rank
    return parts


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(cgroup v2 path, cgroup v1 ``cpu`` controller path) of this process, from
    ``/proc/self/cgroup`` lines ``0::/path`` and ``N:cpu,cpuacct:/path``."""
    v2 = v1 = None
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(root: str, path: str) -> list[str]:
    """``root/a/b``, ``root/a``, ``root``: a parent's limit binds its children too."""
    parts = [p for p in path.split("/") if p]
    return [os.path.join(root, *parts[:i]) for i in range(len(parts), -1, -1)]


def read_cgroup_cpu_quota(
    cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = PROC_SELF_CGROUP
) -> tuple[float | None, str | None]:
    """The tightest CPU quota on this process's cgroup and its ancestors, in CPUs, and the file
    it came from; (None, None) when unlimited or unknown.

    cgroup v2: ``cpu.max`` holds ``"$MAX $PERIOD"`` (``"max 100000"``: unlimited), under the
    root or its hybrid ``unified/`` mount. cgroup v1: ``cpu.cfs_quota_us`` (-1: unlimited) over
    ``cpu.cfs_period_us`` under ``cpu/`` or ``cpu,cpuacct/``. A malformed file is an error:
    silently ignoring a limit is how a container ends up with spinning threads it cannot run."""
    v2_path, v1_path = _cgroup_paths(proc_cgroup)
    best: tuple[float, str] | None = None

    def consider(quota: float, path: str) -> None:
        nonlocal best
        if best is None or quota < best[0]:
            best = (quota, path)

    if v2_path is not None:
        for base in (cgroup_root, os.path.join(cgroup_root, "unified")):
            for d in _ancestors(base, v2_path):
                f = os.path.join(d, "cpu.max")
                text = _read(f)
                if text is None:
                    continue
                fields = text.split()
                if len(fields) not in (1, 2) or (fields[0] != "max" and not fields[0].isdigit()) \
                        or (len(fields) == 2 and not fields[1].isdigit()):
                    raise ValueError(f"{f}: cannot read cgroup CPU quota {text.strip()!r} "
                                     "(expected 'max 100000' or 'QUOTA PERIOD')")
                period = int(fields[1]) if len(fields) == 2 else 100000
                if fields[0] != "max" and period > 0:
                    consider(int(fields[0]) / period, f)
    if v1_path is not None:
        for ctl in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            for d in _ancestors(os.path.join(cgroup_root, ctl), v1_path):
                qf = os.path.join(d, "cpu.cfs_quota_us")
                q, p = _read(qf), _read(os.path.join(d, "cpu.cfs_period_us"))
                if q is None or p is None:
                    continue
                try:
                    quota_us, period_us = int(q), int(p)
                except ValueError:
                    raise ValueError(f"{qf}: cannot read cgroup v1 CPU quota {q.strip()!r} / "
                                     f"period {p.strip()!r}") from None
                if quota_us > 0 and period_us > 0:
                    consider(quota_us / period_us, qf)
    return best if best is not None else (None, None)


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may run on and the CPU time it may use."""

    affinity: tuple[int, ...]
    quota: float | None = None  # CPUs' worth of time per period; None: unlimited
    quota_source: str | None = None

    @property
    def usable(self) -> int:
        """Whole CPUs: a fractional quota rounds down (1.5 CPUs -> 1), never below one."""
        n = len(self.affinity)
        if self.quota is not None:
            n = min(n, max(1, math.floor(self.quota + 1e-9)))
        return max(1, n)

    def describe(self) -> str:
        cpus = _format_cpus(self.affinity)
        quota = f", cgroup quota {self.quota:g} CPUs ({self.quota_source})" if self.quota else ""
        return f"affinity {cpus} ({len(self.affinity)} CPUs){quota}"


def detect_cpu_budget(
    cgroup_root: str = CGROUP_ROOT, proc_cgroup: str = PROC_SELF_CGROUP
) -> CpuBudget:
    """This process's affinity mask and cgroup quota, as they are now."""
    try:
        affinity = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        affinity = tuple(range(os.cpu_count() or 1))
    quota, source = read_cgroup_cpu_quota(cgroup_root, proc_cgroup)
    return CpuBudget(affinity, quota, source)


def _format_cpus(cpus: tuple[int, ...] | list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    items = sorted(cpus)
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


# ---- the start-up plan -------------------------------------------------------------------


@dataclass(frozen=True)
class ThreadPlan:
    threads: int
    bind: tuple[int, ...] | None  # compute thread i runs on CPU bind[i]; None: not bound
    source: str  # what decided the count, for the log line
    budget: CpuBudget
    adaptive: bool

    def describe(self) -> str:
        bind = f", bound to CPUs {','.join(map(str, self.bind))}" if self.bind else ", unbound"
        adapt = ", adaptive (fewer while other processes use these CPUs)" if self.adaptive else ""
        return (f"CPU compute threads: {self.threads} ({self.source}){bind}{adapt}; "
                f"{self.budget.describe()}")


def _positive_int(value: object, what: str, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{what} must be a positive integer, got {value!r}; {hint}")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{what}={value!r} is not a positive integer; {hint}") from None
    if n < 1:
        raise ValueError(f"{what}={value!r} must be at least 1; {hint}")
    return n


def plan_threads(
    budget: CpuBudget,
    env: Mapping[str, str],
    cpu_threads: int | None = None,
    cpu_threads_bind: str | None = None,
    adaptive: bool = True,
) -> ThreadPlan:
    """The compute thread count and binding. Precedence: ``--cpu-threads-bind``, then
    ``VLLM_CPU_OMP_THREADS_BIND`` (a CPU list binds; ``auto`` and ``nobind`` do not), then
    ``--cpu-threads``, then ``OMP_NUM_THREADS``, then the CPUs this process may use.

    Bad values raise ``ValueError`` saying which setting to change."""
    if cpu_threads is not None:
        cpu_threads = _positive_int(cpu_threads, "--cpu-threads", "pass a thread count such as 2")
    bind_text, bind_what = cpu_threads_bind, "--cpu-threads-bind"
    if bind_text is None and env.get(BIND_ENV, "").strip():
        bind_text, bind_what = env[BIND_ENV], BIND_ENV
    bind: list[int] | None = None
    if bind_text is not None:
        text = bind_text.strip()
        if "|" in text:
            raise ValueError(
                f"{bind_what}={bind_text!r} lists CPUs for several workers ('|'); ingot runs one "
                "worker: give one list such as 0-1"
            )
        if text not in ("auto", "nobind", ""):
            bind = parse_cpu_list(text, bind_what)
            outside = sorted(set(bind) - set(budget.affinity))
            if outside:
                raise ValueError(
                    f"{bind_what}={bind_text!r}: CPU {','.join(map(str, outside))} is not one "
                    f"this process may run on ({_format_cpus(budget.affinity)}); choose CPUs "
                    "from that set"
                )
    if bind is not None:
        if cpu_threads is not None and cpu_threads != len(bind):
            raise ValueError(
                f"--cpu-threads {cpu_threads} contradicts {bind_what}={bind_text!r} "
                f"({len(bind)} CPUs, one thread each); drop one of them"
            )
        threads, source = len(bind), f"{bind_what}={bind_text}"
    elif cpu_threads is not None:
        threads, source = cpu_threads, "--cpu-threads"
    elif env.get("OMP_NUM_THREADS", "").strip():
        # OpenMP allows a nested list ("4,2"); the first level is the compute team.
        raw = env["OMP_NUM_THREADS"]
        threads = _positive_int(raw.split(",")[0].strip(), "OMP_NUM_THREADS",
                                "set it to the compute thread count (such as 2) or unset it")
        source = "OMP_NUM_THREADS"
    else:
        threads = budget.usable
        source = ("the cgroup CPU quota" if budget.usable < len(budget.affinity)
                  else "one per CPU this process may use")
    return ThreadPlan(threads, tuple(bind) if bind else None, source, budget,
                      adaptive and threads > 1)


# ---- applying it -------------------------------------------------------------------------


#: Binds the calling thread's OpenMP team, thread i -> cpus[i]: True when bound, None where
#: it cannot run (the worker hands in the C kernels' binding; platforms sit below the kernels).
TeamBinder = Callable[[tuple[int, ...]], "bool | None"]


def _bind_current_team(cpus: tuple[int, ...], team_binder: TeamBinder | None) -> bool:
    """Bind the calling thread's OpenMP team (thread i -> cpus[i]); False if not possible."""
    bound = team_binder(cpus) if team_binder is not None else None
    if bound is not None:
        return bound
    # Without the C kernels: keep the calling thread (the OpenMP master) and the team it
    # creates from now on on the listed CPUs, without one CPU per thread.
    try:
        os.sched_setaffinity(0, set(cpus))
    except (AttributeError, OSError):
        return False
    return True


class CpuThreads:
    """The plan applied to this process, and the controller that may lower it while running."""

    def __init__(self, plan: ThreadPlan, controller: AdaptiveThreads | None = None,
                 team_binder: TeamBinder | None = None) -> None:
        self.plan = plan
        self.controller = controller
        self.team_binder = team_binder
        self._thread: int | None = None

    @property
    def current(self) -> int:
        return self.controller.current if self.controller is not None else self.plan.threads

    def ensure_thread(self) -> None:
        """OpenMP settings are per calling thread: apply them once to each thread that steps
        (``ingot serve`` builds the engine on one thread and steps it on another)."""
        ident = threading.get_ident()
        if ident == self._thread:
            return
        import torch

        torch.set_num_threads(self.current)
        if self.plan.bind is not None and not _bind_current_team(self.plan.bind,
                                                                 self.team_binder):
            logger.warning("could not bind compute threads to CPUs %s; running unbound",
                           ",".join(map(str, self.plan.bind)))
        self._thread = ident

    def execute(self, fn: Callable[[Any], T], scheduler_output: Any) -> T:
        """``fn(scheduler_output)`` on this plan's threads, timed for the controller."""
        self.ensure_thread()
        if self.controller is None or scheduler_output.is_empty:
            return fn(scheduler_output)
        if scheduler_output.is_prefill and self.controller.current != self.plan.threads:
            # Prefill runs oneDNN's GEMMs (a GGUF's dense prefill on AMX among them), whose bits
            # depend on the thread count: at the plan's count always, a prompt's KV cache (so
            # every token after it) does not depend on the machine's load (seen: greedy tokens
            # of one prompt at 1 and 2 threads differed; n-gram speculation then failed its
            # equality with plain decoding under a CPU hog).
            import torch

            torch.set_num_threads(self.plan.threads)
            try:
                return fn(scheduler_output)
            finally:
                torch.set_num_threads(self.controller.current)
        start = time.perf_counter()
        out = fn(scheduler_output)
        self.controller.observe(step_key(scheduler_output), time.perf_counter() - start)
        return out


def step_key(scheduler_output: Any) -> tuple[bool, int, int]:
    """Steps whose times are compared: the same kind at the same padded size (the shape every
    op runs at; the weights' read dominates a decode step, whatever the context length), and
    for decode the rows actually computed too: a verification step of speculative decoding
    computes 1 + d rows per request inside the same bucket, and costs more than a plain decode
    of the same requests without any contention."""
    n = scheduler_output.total_num_scheduled_tokens
    padded = max(n, scheduler_output.num_padded)
    if scheduler_output.is_prefill:
        return True, padded, 0
    return False, padded, n


def start_cpu_threads(config: Any, env: Mapping[str, str] | None = None,
                      team_binder: TeamBinder | None = None) -> CpuThreads:
    """Plan from this process's CPU budget, its environment and ``config.cpu_threads`` (a
    config.CpuThreadsConfig), apply it to the calling thread and log it; the returned object
    keeps it applied (and adaptive) on whichever thread steps, binding threads to CPUs with
    ``team_binder`` where it can (else the process's affinity)."""
    c = config.cpu_threads
    plan = plan_threads(detect_cpu_budget(), os.environ if env is None else env, c.threads,
                        c.bind, c.adaptive)
    logger.info("%s", plan.describe())
    if plan.threads > plan.budget.usable:
        logger.warning(
            "%d CPU compute threads (%s) but this process may use %d CPU(s): threads will "
            "share CPUs and wait for each other at every op; expect slower steps",
            plan.threads, plan.source, plan.budget.usable,
        )
    controller = None
    if plan.adaptive and config.compilation.enabled:
        # Inductor bakes the thread count into the kernels it generates (and its cache key):
        # switching counts would recompile while serving, which compiled engines must never do.
        logger.info("adaptive CPU threads off: compiled layers keep %d threads", plan.threads)
    elif plan.adaptive:
        import torch

        controller = AdaptiveThreads(plan.threads, cpus=plan.bind or plan.budget.affinity,
                                     set_threads=torch.set_num_threads)
    threads = CpuThreads(plan, controller, team_binder)
    threads.ensure_thread()
    return threads


# ---- while running -----------------------------------------------------------------------


def read_other_cpu_use(
    cpus: tuple[int, ...] | list[int],
    proc_stat: str = PROC_STAT,
    proc_self_stat: str = PROC_SELF_STAT,
) -> tuple[float, float] | None:
    """(busy seconds of ``cpus``, CPU seconds of this process) since boot; None if unknown.

    Busy counts user, nice, system, irq, softirq and steal (a hypervisor running someone else
    on our CPU is contention too); the difference of two readings is what others used."""
    stat, self_stat = _read(proc_stat), _read(proc_self_stat)
    if stat is None or self_stat is None:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    wanted = {f"cpu{c}" for c in cpus}
    busy = 0
    seen = 0
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            v = [int(x) for x in fields[1:9]] + [0] * max(0, 8 - len(fields[1:9]))
            user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
            busy += user + nice + system + irq + softirq + steal
            seen += 1
    if not seen:
        return None
    # /proc/self/stat: the command name may hold spaces; fields after ")" are fixed.
    rest = self_stat.rsplit(")", 1)[-1].split()
    try:
        mine = int(rest[11]) + int(rest[12])  # utime, stime (fields 14, 15)
    except (IndexError, ValueError):
        return None
    return busy / hz, mine / hz


@dataclass
class _Probe:
    threads: int
    key: object
    before: float  # median step time at the current count, for the same key
    why: str
    samples: list[float]
    steps: int = 0


class AdaptiveThreads:
    """Hill-climbs the compute thread count between 1 and ``max_threads``, one step at a time.

    A *probe* runs ``probe_steps`` steps of one shape at a neighbouring count and moves there if
    their median is at least ``margin`` faster than the recent median at the current count.
    Probes downward start when other processes use at least ``busy_cpus`` of our CPUs (from
    /proc/stat, so a quiet machine never pays for probing) or when a shape's recent steps take
    ``slow_ratio`` times their own earlier median; probes upward start when the machine is quiet
    again, and also on a timer (``retry_s``, doubling after each probe that changes nothing) in
    case /proc/stat says nothing useful, as in some containers."""

    def __init__(
        self,
        max_threads: int,
        cpus: tuple[int, ...] | list[int] = (),
        set_threads: Callable[[int], None] = lambda n: None,
        *,
        window: int = 4,
        probe_steps: int = 3,
        margin: float = 0.05,
        slow_ratio: float = 1.5,
        busy_cpus: float = 0.5,
        quiet_cpus: float = 0.25,
        sample_s: float = 0.25,
        retry_s: float = 2.0,
        max_retry_s: float = 32.0,
        clock: Callable[[], float] = time.monotonic,
        read_use: Callable[[], tuple[float, float] | None] | None = None,
    ) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        self.max_threads = max_threads
        self.current = max_threads
        self._set = set_threads
        self.window, self.probe_steps, self.margin = window, probe_steps, margin
        self.slow_ratio, self.busy_cpus, self.quiet_cpus = slow_ratio, busy_cpus, quiet_cpus
        self.sample_s, self.retry_s, self.max_retry_s = sample_s, retry_s, max_retry_s
        self._clock = clock
        self._read_use = read_use if read_use is not None else (
            lambda: read_other_cpu_use(tuple(cpus)))
        self.recent: dict[tuple[object, int], deque[float]] = {}
        self.baseline: dict[tuple[object, int], float] = {}
        self.probe: _Probe | None = None
        self.others: float | None = None  # CPUs other processes used over the last sample
        self.switches: list[tuple[float, int, int, str]] = []  # (time, from, to, why)
        self._last_use: tuple[float, float, float] | None = None
        self._next_sample = 0.0
        self._retry_at: dict[int, float] = {}  # probe target -> earliest time to try it again
        self._retry_gap: dict[int, float] = {}
        # A first sample now (start-up, before warmup): the first step's observation then
        # already knows whether others use our CPUs, and a contended start probes at once
        # after one step instead of two (a first contended prefill step took ~10 s).
        self._sample_others(self._clock())

    # -- inputs --
    def _sample_others(self, now: float) -> None:
        if now < self._next_sample:
            return
        self._next_sample = now + self.sample_s
        use = self._read_use()
        if use is None:
            self.others = None
            return
        if self._last_use is not None:
            t0, busy0, mine0 = self._last_use
            if now > t0:
                was_busy = self.others is not None and self.others >= self.busy_cpus
                self.others = max(0.0, ((use[0] - busy0) - (use[1] - mine0)) / (now - t0))
                if was_busy != (self.others >= self.busy_cpus):
                    # The machine changed: what earlier probes found no longer holds.
                    self._retry_at.clear()
                    self._retry_gap.clear()
        self._last_use = (now, use[0], use[1])

    def observe(self, key: object, seconds: float) -> None:
        """Record one step of shape ``key`` that took ``seconds`` at the current count."""
        now = self._clock()
        self._sample_others(now)
        if self.probe is not None:
            self._observe_probe(key, seconds, now)
            return
        hist = self.recent.setdefault((key, self.current), deque(maxlen=self.window))
        hist.append(seconds)
        med = statistics.median(hist)
        down, up = self.current - 1, self.current + 1
        busy = self.others is not None and self.others >= self.busy_cpus
        # Other processes on our CPUs: probe at once, on whatever steps there are (a contended
        # 2-thread step was measured at 25x a 1-thread one; waiting for a full window costs).
        if busy and down >= 1 and self._may(down, now):
            return self._start(down, key, med, f"other processes use {self.others:.1f} CPUs")
        if len(hist) < self.window:
            return
        base = self.baseline.get((key, self.current))
        if base is None or med < base:
            self.baseline[(key, self.current)] = base = med
        if down >= 1 and med > self.slow_ratio * base and self._may(down, now):
            return self._start(down, key, med,
                               f"steps take {med / base:.1f}x their recent median")
        # Upward only while /proc/stat does not show others busy: under contention a probe of
        # more threads costs steps many times slower, for nothing.
        if up <= self.max_threads and not busy and self._may(up, now):
            quiet = self.others is not None and self.others < self.quiet_cpus
            return self._start(up, key, med, "the CPUs look free again" if quiet
                               else "periodic retry")

    # -- probes --
    def _may(self, target: int, now: float) -> bool:
        return now >= self._retry_at.get(target, 0.0)

    def _start(self, target: int, key: object, before: float, why: str) -> None:
        logger.debug("probing %d compute threads (now %d): %s", target, self.current, why)
        self.probe = _Probe(target, key, before, why, [])
        self._set(target)

    def _observe_probe(self, key: object, seconds: float, now: float) -> None:
        p = self.probe
        assert p is not None
        p.steps += 1
        if key == p.key:
            p.samples.append(seconds)
        # One probe step twice as slow as before settles it: do not pay for two more; nor
        # for more of the slow count when one probe step took half the time or less.
        hopeless = key == p.key and seconds > 2.0 * p.before
        decisive = key == p.key and seconds < 0.5 * p.before
        if not (hopeless or decisive) and len(p.samples) < self.probe_steps and \
                p.steps < 4 * self.probe_steps:
            return
        self.probe = None
        if decisive or (len(p.samples) >= self.probe_steps and
                        statistics.median(p.samples) < (1.0 - self.margin) * p.before):
            old = self.current
            self.current = p.threads
            self.switches.append((now, old, p.threads, p.why))
            logger.info("CPU compute threads %d -> %d: %s; step %.1f -> %.1f ms", old,
                        p.threads, p.why, p.before * 1e3, statistics.median(p.samples) * 1e3)
            # Start afresh at the new count; going straight back is allowed after the gap.
            self._retry_gap.pop(p.threads, None)
            self._retry_at[old] = now + self.retry_s
            self.recent = {k: v for k, v in self.recent.items() if k[1] != old}
            self.baseline = {k: v for k, v in self.baseline.items() if k[1] != old}
            return
        # Not better: stay, and wait longer before trying that count again.
        self._set(self.current)
        gap = min(self._retry_gap.get(p.threads, self.retry_s / 2) * 2, self.max_retry_s)
        self._retry_gap[p.threads] = gap
        self._retry_at[p.threads] = now + gap
        # The slow steps are the new normal for this count: do not re-trigger on them.
        hist = self.recent.get((p.key, self.current))
        if hist:
            self.baseline[(p.key, self.current)] = statistics.median(hist)
