"""Step-driven torch.profiler control for /start_profile and /stop_profile.

The original's state machine: after a start, wait ``delay_iterations`` forward steps, then
record for at most ``max_iterations`` steps (0 = until stopped), then write one Chrome/Perfetto
trace per rank into a fresh directory under ``output_dir`` (one directory per start/stop cycle).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

import torch

from ingot.config import ProfilerConfig

logger = logging.getLogger("ingot")

_CYCLES = itertools.count(1)


class StepProfiler:
    def __init__(self, config: ProfilerConfig, rank: int = 0, device_type: str = "cpu") -> None:
        self.config = config
        self.rank = rank
        self.device_type = device_type
        self.enabled = rank in (config.ranks if config.ranks is not None else [0])
        self._profiler: torch.profiler.profile | None = None
        self._delay_left = 0
        self._recorded = 0
        self._armed = False
        self.last_trace: Path | None = None
        # A trace written because max_iterations ran out, not yet reported by stop().
        self._unreported: Path | None = None

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        if not self.enabled:
            return
        if self._armed or self.active:
            raise ValueError("the profiler is already running; call /stop_profile first")
        self._armed = True
        self._unreported = None
        self._delay_left = self.config.delay_iterations
        self._recorded = 0
        if self._delay_left == 0:
            self._begin()

    def _begin(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=self.config.record_shapes,
            with_stack=self.config.with_stack,
        )
        self._profiler.__enter__()
        logger.info("profiler recording (rank %d)", self.rank)

    def step(self) -> None:
        """Called once per forward step."""
        if not self._armed:
            return
        if not self.active:
            if self._delay_left > 0:
                self._delay_left -= 1
                if self._delay_left == 0:
                    self._begin()
            return
        self._recorded += 1
        if self.config.max_iterations and self._recorded >= self.config.max_iterations:
            self._unreported = self._finish()

    def stop(self) -> Path | None:
        """Stops recording and writes the trace; returns its path. After an automatic stop
        (max_iterations reached) returns that trace once, so /stop_profile can report it."""
        if not self._armed:
            path, self._unreported = self._unreported, None
            return path
        return self._finish()

    def _finish(self) -> Path | None:
        self._armed = False
        self._unreported = None
        if self._profiler is None:  # stopped during the delay: nothing was recorded
            return None
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        # One fresh directory per start/stop cycle; the process-wide cycle number keeps two
        # cycles within the same second (or two engines in one process) apart.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        cycle = next(_CYCLES)
        out_dir = Path(self.config.output_dir) / f"{stamp}_pid{os.getpid()}_cycle{cycle}"
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"rank{self.rank}.trace.json"
        profiler.export_chrome_trace(str(path))
        self.last_trace = path
        logger.info("profiler trace (%d steps) written to %s", self._recorded, path)
        return path
