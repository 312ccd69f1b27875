"""tinyvllm: a small vLLM for Llama models, built chapter by chapter in NumPy and CuPy."""
from tinyvllm.errors import TinyVLLMError
from tinyvllm.sampling import Logprob, SamplingParams


def __getattr__(name: str):  # LLM pulls in the model code: import it only when asked for
    if name == "LLM":
        from tinyvllm.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "Logprob", "SamplingParams", "TinyVLLMError"]
