"""Executors run the model on one or more workers; one in-process worker for now."""

from __future__ import annotations

from ingot.config import EngineConfig
from ingot.core.sched_output import SchedulerOutput
from ingot.worker.model_runner import ModelRunnerOutput
from ingot.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)

    @property
    def num_blocks(self) -> int:
        blocks = self.worker.config.cache_config.num_blocks
        assert blocks is not None
        return blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def profile(self, is_start: bool) -> str | None:
        return self.worker.profile(is_start)
