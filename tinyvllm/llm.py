"""The Python API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.

    from tinyvllm import LLM, SamplingParams
    llm = LLM("default")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)

`generate` takes raw text (no chat template), `chat` applies the model's template, as in vLLM.

The prompt goes through the engine's prefill (chapter 3), which fills the paged KV cache (chapter 6);
each next token is one decode step (chapter 5) reading it. The same code runs on either device.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.backend import resolve_device
from tinyvllm.config import load_config
from tinyvllm.decode import decode_step
from tinyvllm.errors import TinyVLLMError
from tinyvllm.block_manager import BLOCK_SIZE, blocks_for
from tinyvllm.model import Model
from tinyvllm.models import resolve_model
from tinyvllm.paged_cache import PagedKVCache, pool_blocks
from tinyvllm.prefill import prefill
from tinyvllm.sampling import SamplingParams, sample
from tinyvllm.tokenizer import IncrementalDecoder, load_tokenizer

# Tokens the prefill buffers hold (float32 on the CPU: ~32 KB per token for SmolLM2; bf16 on the GPU).
MAX_PREFILL_TOKENS = {"cpu": 4096, "cuda": 8192}


@dataclass
class CompletionOutput:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (stop token or string) or "length" (max_tokens / context)


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    timings: dict[str, float] = field(default_factory=dict)  # seconds, and decode tokens/s

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


class LLM:
    def __init__(self, model: str = "default", device: str = "auto", max_model_len: int | None = None,
                 num_blocks: int | None = None, gpu_memory_utilization: float = 0.9):
        self.device = resolve_device(device)
        self.model_dir = resolve_model(model)
        load_config(self.model_dir)  # a bad config.json is reported before anything else is read
        self.tokenizer = load_tokenizer(self.model_dir)
        self.engine = Model(self.model_dir, self.device, max_model_len=max_model_len,
                            max_tokens=MAX_PREFILL_TOKENS[self.device])
        self.config, self.max_model_len = self.engine.cfg, self.engine.max_model_len
        self.stop_token_ids = sorted(set(self.tokenizer.stop_token_ids) | set(self.config.eos_token_ids))
        # the paged KV cache (chapter 6): one pool of 16-token blocks, sized once from what memory is left
        blocks = num_blocks or pool_blocks(self.config, self.engine.ops, gpu_memory_utilization)
        self.cache = PagedKVCache(self.config, self.engine.ops, blocks)
        self._next_seq = 0

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Complete raw prompts (text, or token id lists); outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        outputs = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            outputs.append(self._run(prompt if isinstance(prompt, str) else None, ids, params))
        return outputs

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate the replies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = sampling_params or SamplingParams()
        return [self._run(None, self.tokenizer.apply_chat_template(c), params) for c in conversations]

    def _run(self, prompt: str | None, ids: list[int], params: SamplingParams) -> RequestOutput:
        out = RequestOutput(prompt, ids, [CompletionOutput()])
        for _ in self.stream(ids, params, out):
            pass
        return out

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               out: RequestOutput | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as soon as it is complete UTF-8 and past any stop string."""
        self._check_prompt(prompt_ids)
        out = out or RequestOutput(None, prompt_ids, [CompletionOutput()])
        completion, timings = out.outputs[0], out.timings
        budget = self.max_model_len - len(prompt_ids)
        max_tokens = min(params.max_tokens or budget, budget)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.stop_token_ids))
        rng = np.random.default_rng(params.seed)
        decoder, held = IncrementalDecoder(self.tokenizer), ""  # held: text that may start a stop string
        hold = max((len(s) for s in params.stop), default=1) - 1

        seq, start = self._start_sequence(len(prompt_ids) + max_tokens), time.perf_counter()
        try:  # whatever happens (done, error, the caller stops iterating), the blocks go back to the pool
            logits, _ = prefill(self.engine, prompt_ids, cache=self.cache, seq=seq)
            timings["prefill_s"] = time.perf_counter() - start
            stopped_by_string = False
            while True:
                token = sample(logits, params, rng)  # on the logits' device: only the id crosses to the host
                completion.token_ids.append(token)
                if token in stop_ids:
                    completion.finish_reason = "stop"
                    break
                held += decoder.feed(token)
                cut = min((i for i in (held.find(s) for s in params.stop) if i >= 0), default=-1)
                if cut >= 0:  # a stop string ends the text exactly where it begins
                    held, stopped_by_string, completion.finish_reason = held[:cut], True, "stop"
                    break
                keep = max(len(held) - hold, 0)  # the last `hold` chars may be the start of a stop string
                ready, held = held[:keep], held[keep:]
                completion.text += ready
                if ready:
                    yield ready
                if len(completion.token_ids) >= max_tokens:
                    completion.finish_reason = "length"
                    break
                logits = decode_step(self.engine, [token], self.cache, [seq])[0]
        finally:
            self.cache.free(seq)
        if not stopped_by_string:
            held += decoder.flush()
        completion.text += held
        if held:
            yield held
        timings["total_s"] = time.perf_counter() - start
        steps = len(completion.token_ids) - 1  # the first token came from the prefill's logits
        timings["decode_s"] = timings["total_s"] - timings["prefill_s"]
        timings["decode_tokens_per_s"] = steps / timings["decode_s"] if steps else 0.0

    def _start_sequence(self, max_tokens: int) -> int:
        """A new sequence id, once it is sure that its prompt and every token it may generate fit the pool."""
        if blocks_for(max_tokens) > self.cache.num_blocks:
            raise TinyVLLMError(f"this request may need {max_tokens} tokens of KV cache ({blocks_for(max_tokens)} "
                                f"blocks) but the pool holds {self.cache.num_blocks} blocks of {BLOCK_SIZE}; "
                                "lower max_tokens or give the cache more memory")
        self._next_seq += 1
        return self._next_seq

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise TinyVLLMError("the prompt is empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise TinyVLLMError(f"the prompt has {len(ids)} tokens but the context window is "
                                f"{self.max_model_len}; shorten the prompt")
        if len(ids) > self.engine.max_tokens:
            raise TinyVLLMError(f"the prompt has {len(ids)} tokens; prefill on the {self.device} takes at most "
                                f"{self.engine.max_tokens}; shorten the prompt")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise TinyVLLMError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
