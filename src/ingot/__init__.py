"""ingot: an LLM inference and serving engine with a vLLM-compatible surface."""

from ingot.engine.outputs import CompletionOutput, Logprob, RequestOutput
from ingot.engine.sampling_params import SamplingParams
from ingot.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):  # noqa: ANN202
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from ingot.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'ingot' has no attribute {name!r}")
