"""ingot: an LLM inference and serving engine with a vLLM-compatible surface."""

from ingot.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]

# Everything but the version is imported on first use: the `ingot` command starts by importing
# this package, and a Ctrl-C during a heavy import here would escape the CLI's handler.
_LAZY = {
    "LLM": "ingot.entrypoints.llm",
    "SamplingParams": "ingot.sampling_params",
    "RequestOutput": "ingot.engine.outputs",
    "CompletionOutput": "ingot.engine.outputs",
    "Logprob": "ingot.engine.outputs",
}


def __getattr__(name: str):  # noqa: ANN202
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ingot' has no attribute {name!r}")
