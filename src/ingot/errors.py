"""Errors a user can cause. Each message says what to change."""


class IngotError(Exception):
    """Base class for ingot's user-facing errors."""


class ModelNotFoundError(IngotError, ValueError):
    """The --model path does not exist or holds no loadable model."""


class PromptTooLongError(IngotError, ValueError):
    """A prompt is longer than max_model_len allows."""
