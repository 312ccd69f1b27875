"""Chapter 7: the engine's settings in one object, checked once and clamped once.

What a user asks for (LLM(...), the CLI's flags, the server's) and what the machine allows meet here:
max_model_len is at most the model's context and what the KV pool holds; a step's tokens at most the
model's step buffers; the sequences of a decode step at most that many rows. Everything after this
file reads the clamped values. Picklable: `serve` sends it to the engine process.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace

from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.config import LlamaConfig
from tinyvllm.model.step_plan import BLOCK_SIZE

# Tokens one step computes, at most by default: the rows of the model's step buffers (float32 on the CPU:
# ~32 KB per token of SmolLM2; bf16 on the GPU)
MAX_STEP_TOKENS = {"cpu": 4096, "cuda": 8192}
# On the CPU a step costs in proportion to its tokens: its default budget is the tokens whose products with
# the layers' weights take about this many FLOPs, roughly 0.3 s on two laptop cores (64 tokens of SmolLM2-135M)
CPU_STEP_FLOPS = 1.5e10
# The most tokens of one prompt a step computes, by default: a short prompt arriving beside a long one
# waits about one such step, not the long prompt's whole prefill. The CPU's budget is already small: half
# of it; a GPU's is sized for throughput: 1,024 of its 8,192 keep a step of a 1B model in milliseconds.
LONG_PREFILL_SHARE = {"cpu": 2, "cuda": 8}
SPECULATIVE_METHODS = ("ngram", "early_exit", "draft_model")   # chapter 10's proposers (engine/spec_decode.py)
# vLLM's speculative_config keys (and num_draft_layers, early exit's), and the EngineConfig field each one sets
SPECULATIVE_CONFIG_KEYS = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
                           "prompt_lookup_max": "prompt_lookup_max", "prompt_lookup_min": "prompt_lookup_min",
                           "num_draft_layers": "num_draft_layers", "model": "speculative_model"}


def speculative_settings(speculative_config: dict | str) -> dict:
    """vLLM's speculative_config — {"method": "ngram", "num_speculative_tokens": 4, ...}, or that as JSON text (the
    CLI's --speculative-config) — as EngineConfig settings; their values are checked by EngineConfig."""
    if isinstance(speculative_config, str):
        try:
            speculative_config = json.loads(speculative_config)
        except json.JSONDecodeError as e:
            raise TinyVLLMError(f"speculative_config is not JSON ({e.msg} at character {e.pos}): give e.g. "
                                '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
    if not isinstance(speculative_config, dict):
        raise TinyVLLMError(f"speculative_config must be an object such as {{\"method\": \"ngram\"}}, got "
                            f"{speculative_config!r}")
    unknown = sorted(set(speculative_config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise TinyVLLMError(f"speculative_config has unknown keys {unknown}; the keys are {list(SPECULATIVE_CONFIG_KEYS)}")
    if speculative_config.get("method") is None and speculative_config.get("model") is not None:
        # vLLM's rule: a model without a method is a draft model ("ngram" as the model name: prompt lookup)
        method = "ngram" if speculative_config["model"] in ("ngram", "[ngram]") else "draft_model"
        speculative_config = {**speculative_config, "method": method}
        if method == "ngram":
            del speculative_config["model"]
    return {SPECULATIVE_CONFIG_KEYS[key]: value for key, value in speculative_config.items()}


def layer_flops_per_token(cfg: LlamaConfig) -> int:
    """2 FLOPs (a multiply and an add) per weight of the decoder layers, for every token of a step."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * (2 * cfg.q_size + 2 * cfg.kv_size) + 3 * h * inter   # q, o, k, v; gate, up, down
    return 2 * cfg.num_hidden_layers * per_layer


def default_step_tokens(device: str, cfg: LlamaConfig) -> int:
    """The device's step budget for this model: a multiple of the block size on the CPU (see CPU_STEP_FLOPS)."""
    if device != "cpu":
        return MAX_STEP_TOKENS[device]
    tokens = int(CPU_STEP_FLOPS // layer_flops_per_token(cfg)) // BLOCK_SIZE * BLOCK_SIZE
    return min(MAX_STEP_TOKENS["cpu"], max(BLOCK_SIZE, tokens))


def setting(default, help: str, choices: tuple | None = None):
    """An EngineConfig field with its help text: the CLI's flag (--the-name) is made from it, for every command."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, in one place: LLM(model, **settings), the CLI's engine flags and `serve` all
    build this; `clamped` fits it to the model and the machine."""
    model: str = setting("default", "'default' (SmolLM2-135M-Instruct), a synthetic preset, or a HF model directory")
    device: str = setting("auto", "where the model runs: a GPU if CuPy sees one (auto), or this one",
                          ("auto", "cpu", "cuda"))
    max_model_len: int | None = setting(None, "context window (default: the model's, lowered to what the KV "
                                              "cache pool holds)")
    num_blocks: int | None = setting(None, "KV cache blocks of 16 tokens (default: what memory allows)")
    gpu_memory_utilization: float = setting(0.9, "fraction of GPU memory for weights, buffers and the KV cache")
    max_num_seqs: int = setting(256, "sequences running at once (a decode step's rows)")
    max_num_batched_tokens: int | None = setting(
        None, f"a step's token budget (its buffers' rows); longer prompts are prefilled in chunks (default: "
              f"{MAX_STEP_TOKENS['cuda']} on a GPU; on the CPU, from the model's size: 64 for SmolLM2-135M)")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of prompt prefixes seen before (shared "
                                                "system prompts, n > 1): vLLM v1's default")
    enforce_eager: bool = setting(False, "no CUDA graphs for decode steps (slower; for debugging)")
    async_scheduling: bool = setting(True, "plan and launch the next step before this one's tokens are read back, "
                                           "so the host's work hides behind the GPU's (on a GPU; not with "
                                           "speculative decoding)")
    batch_invariant: bool = setting(False, "a request's output never depends on what else is batched with it "
                                           "(slower: kernels that sum in one fixed order)")
    long_prefill_token_threshold: int | None = setting(
        None, "the most tokens of one prompt a step computes, so that short prompts start beside a long one "
              f"(default: a share of the budget, 1/{LONG_PREFILL_SHARE['cpu']} on the CPU, "
              f"1/{LONG_PREFILL_SHARE['cuda']} on a GPU)")
    speculative_method: str | None = setting(
        None, "speculative decoding: 'ngram' proposes the tokens that followed the last few tokens earlier in the "
              "prompt and output (prompt lookup); 'early_exit' the model's own first num_draft_layers layers; "
              "'draft_model' a second, smaller model with the same vocabulary (speculative_model); every step "
              "verifies them (default: off)", SPECULATIVE_METHODS)
    num_speculative_tokens: int = setting(4, "tokens proposed per sequence and step, with speculative_method")
    prompt_lookup_max: int = setting(4, "ngram: the longest suffix looked up in the prompt and output")
    prompt_lookup_min: int = setting(2, "ngram: the shortest suffix looked up (shorter ones match more, but "
                                        "their guesses are kept less often)")
    num_draft_layers: int | None = setting(None, "early_exit: the layers the draft runs, 1 to the model's layers - 1 "
                                                 "(more: better guesses, dearer ones)")
    speculative_model: str | None = setting(None, "draft_model: the draft, 'default' or a HF model directory with "
                                                  "the model's vocabulary (speculative_config's \"model\")")

    def __post_init__(self) -> None:
        for name in ("max_model_len", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "long_prefill_token_threshold", "num_speculative_tokens", "prompt_lookup_max",
                     "prompt_lookup_min", "num_draft_layers"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise TinyVLLMError(f"{name} must be a positive whole number, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise TinyVLLMError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise TinyVLLMError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)} (or None for "
                                f"no speculation), got {self.speculative_method!r}")
        if self.speculative_method == "early_exit" and self.num_draft_layers is None:
            raise TinyVLLMError("speculative_method early_exit needs num_draft_layers: how many of the model's first "
                                "layers make the draft")
        if self.speculative_method == "draft_model" and not self.speculative_model:
            raise TinyVLLMError('speculative_method draft_model needs the draft: speculative_config\'s "model" (or '
                                "speculative_model), 'default' or a HF model directory")
        if self.speculative_model is not None and self.speculative_method != "draft_model":
            raise TinyVLLMError(f"speculative_model {self.speculative_model!r} is draft_model's, but speculative_method "
                                f"is {self.speculative_method!r}; give method draft_model, or leave the model out")
        if self.num_draft_layers is not None and self.speculative_method == "draft_model":
            raise TinyVLLMError("num_draft_layers is early_exit's; a draft_model runs all of its own layers")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise TinyVLLMError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                                f"({self.prompt_lookup_max})")

    def check_model(self, cfg: LlamaConfig, draft_cfg: LlamaConfig | None = None) -> None:
        """The settings that depend on the model (and the draft model's config, with draft_model), checked before
        any weights are read."""
        layers = cfg.num_hidden_layers
        if self.speculative_method == "early_exit" and not self.num_draft_layers < layers:
            raise TinyVLLMError(f"num_draft_layers must be 1 to {layers - 1} for this model of {layers} layers (the "
                                f"draft is its first layers, never all of them), got {self.num_draft_layers}")
        if draft_cfg is not None and draft_cfg.vocab_size != cfg.vocab_size:
            # a guess is a token id: the target must read the draft's ids as the same tokens
            raise TinyVLLMError(f"the draft model {self.speculative_model} has a vocabulary of {draft_cfg.vocab_size} "
                                f"tokens, the model {cfg.vocab_size}; a draft_model must share the model's tokenizer")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def default(cls, name: str):
        return next(f.default for f in fields(cls) if f.name == name)

    def step_tokens(self, device: str, cfg: LlamaConfig) -> int:
        """Rows of the model's step buffers: the step's token budget (the device's default unless asked).
        Not capped by the context window: a step holds many sequences' tokens, each within the window
        (vLLM sets max_num_batched_tokens apart from max_model_len for the same reason)."""
        return self.max_num_batched_tokens or default_step_tokens(device, cfg)

    def clamped(self, device: str, cfg: LlamaConfig, num_blocks: int) -> EngineConfig:
        """These settings as the engine will run them, on `device`, with the model `cfg` (max_model_len
        applied) and a pool of num_blocks blocks."""
        step_tokens = self.step_tokens(device, cfg)
        long_prefill = self.long_prefill_token_threshold or step_tokens // LONG_PREFILL_SHARE[device]
        return replace(self, device=device, num_blocks=num_blocks,
                       max_model_len=min(cfg.context_window(self.max_model_len), num_blocks * BLOCK_SIZE),  # one sequence fits the pool
                       max_num_batched_tokens=step_tokens,
                       long_prefill_token_threshold=max(1, min(step_tokens, long_prefill)),
                       max_num_seqs=min(self.max_num_seqs, step_tokens))      # a decode step's rows are buffer rows


def with_speculative_config(settings: dict, speculative_config: dict | str | None) -> dict:
    """settings with vLLM's speculative_config folded in (speculative_settings); a setting given
    both ways is a mistake, not a silent choice."""
    if speculative_config is None:
        return settings
    speculative = speculative_settings(speculative_config)
    both = sorted(name for name in speculative if settings.get(name) not in (None, EngineConfig.default(name)))
    if both:
        raise TinyVLLMError(f"{both} given both on their own and in speculative_config: give them once")
    return {**settings, **speculative}
