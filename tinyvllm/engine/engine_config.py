"""Chapter 7: the engine's settings in one object, checked once and clamped once.

What a user asks for (LLM(...), the CLI's flags, the server's) and what the machine allows meet here:
max_model_len is at most the model's context and what the KV pool holds; a step's tokens at most the
model's step buffers; the sequences of a decode step at most that many rows. Everything after this
file reads the clamped values. Picklable: `serve` sends it to the engine process.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.kv_pool import BLOCK_SIZE

# Tokens one step computes: the rows of the model's step buffers (float32 on the CPU: ~32 KB per token of
# SmolLM2; bf16 on the GPU)
MAX_STEP_TOKENS = {"cpu": 4096, "cuda": 8192}


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"                       # "default", a synthetic preset, or a model directory
    device: str = "auto"                         # "auto", "cpu" or "cuda"
    max_model_len: int | None = None             # context window: None = the model's, lowered to the pool's
    num_blocks: int | None = None                # KV pool blocks of 16 tokens: None = what memory allows
    gpu_memory_utilization: float = 0.9          # share of the GPU's memory for weights, buffers and the pool
    max_num_seqs: int = 256                      # sequences running at once
    max_num_batched_tokens: int | None = None    # the token budget of a step (its buffers' rows): None = the
                                                 # device's MAX_STEP_TOKENS; longer prompts go in chunks
    enable_prefix_caching: bool = True           # vLLM v1's default: full blocks shared between prompts
    enforce_eager: bool = False                  # no CUDA graphs for decode
    batch_invariant: bool = False                # a sequence's logits never depend on its batch (slower)

    def __post_init__(self) -> None:
        for name in ("max_model_len", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise TinyVLLMError(f"{name} must be a positive whole number, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise TinyVLLMError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def step_tokens(self, device: str) -> int:
        """Rows of the model's step buffers: the step's token budget (the device's default unless asked).
        Not capped by the context window: a step holds many sequences' tokens, each within the window
        (vLLM sets max_num_batched_tokens apart from max_model_len for the same reason)."""
        return self.max_num_batched_tokens or MAX_STEP_TOKENS[device]

    def clamped(self, device: str, model_len: int, num_blocks: int) -> EngineConfig:
        """These settings as the engine will run them, on `device`, with a model whose context is model_len
        (max_model_len applied) and a pool of num_blocks blocks."""
        step_tokens = self.step_tokens(device)
        return replace(self, device=device, num_blocks=num_blocks,
                       max_model_len=min(model_len, num_blocks * BLOCK_SIZE),  # one sequence must fit the pool
                       max_num_batched_tokens=step_tokens,
                       max_num_seqs=min(self.max_num_seqs, step_tokens))      # a decode step's rows are buffer rows
