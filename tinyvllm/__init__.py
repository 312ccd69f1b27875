"""tinyvllm: a small vLLM for Llama models, built chapter by chapter in NumPy and CuPy."""
from tinyvllm.engine.sampling import Logprob, SamplingParams
from tinyvllm.engine.structured.params import StructuredOutputsParams
from tinyvllm.errors import TinyVLLMError


def __getattr__(name: str):  # LLM pulls in the model code: import it only when asked for
    if name == "LLM":
        from tinyvllm.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "Logprob", "SamplingParams", "StructuredOutputsParams", "TinyVLLMError"]
