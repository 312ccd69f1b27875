"""The Python API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.

    from tinyvllm import LLM, SamplingParams
    llm = LLM("default")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)

`generate` takes raw text (no chat template), `chat` applies the model's template, as in vLLM.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from tinyvllm.config import load_config
from tinyvllm.errors import TinyVLLMError
from tinyvllm.models import resolve_model
from tinyvllm.reference import ReferenceModel
from tinyvllm.sampling import SamplingParams, sample
from tinyvllm.tokenizer import IncrementalDecoder, load_tokenizer
from tinyvllm.weights import load_weights


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


def resolve_device(device: str) -> str:
    if device not in ("auto", "cpu", "cuda"):
        raise TinyVLLMError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda":
        raise TinyVLLMError("the CUDA backend is built in chapter 3 and not available yet; use --device cpu")
    return "cpu"


class LLM:
    def __init__(self, model: str = "default", device: str = "auto", max_model_len: int | None = None):
        self.device = resolve_device(device)
        self.model_dir = resolve_model(model)
        self.config = load_config(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.model = ReferenceModel(self.config, load_weights(self.model_dir, self.config).views)
        self.stop_token_ids = sorted(set(self.tokenizer.stop_token_ids) | set(self.config.eos_token_ids))

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

        start = time.perf_counter()
        cache = self.model.new_cache(len(prompt_ids) + max_tokens)
        logits = self.model.forward(prompt_ids, cache, all_logits=False)
        timings["prefill_s"] = time.perf_counter() - start
        stopped_by_string = False
        while True:
            token = sample(logits, params, rng)
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
            logits = self.model.forward([token], cache, all_logits=False)
        if not stopped_by_string:
            held += decoder.flush()
        completion.text += held
        if held:
            yield held
        timings["total_s"] = time.perf_counter() - start
        steps = len(completion.token_ids) - 1  # the first token came from the prefill's logits
        timings["decode_s"] = timings["total_s"] - timings["prefill_s"]
        timings["decode_tokens_per_s"] = steps / timings["decode_s"] if steps else 0.0

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise TinyVLLMError("the prompt is empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise TinyVLLMError(f"the prompt has {len(ids)} tokens but the context window is "
                                f"{self.max_model_len}; shorten the prompt")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise TinyVLLMError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
