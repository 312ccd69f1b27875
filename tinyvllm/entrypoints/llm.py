"""The Python API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`.

    from tinyvllm import LLM, SamplingParams
    llm = LLM("default")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)

`generate` takes raw text (no chat template), `chat` applies the model's template, as in vLLM.
`llm.close()`, or a `with LLM(...) as llm:` block, frees the model and its KV cache at once (on a GPU,
memory that a later LLM in the same process, or another process, can then have).

Every request goes through the engine loop (chapter 7): prompts are prefilled in batches (chapter 3)
into the paged KV cache (chapter 6), and every running sequence decodes one token per step (chapter 5).
The same code runs on either device. A request for n samples (SamplingParams.n) runs as n sequences,
sample i with params.child(i), as vLLM's parallel sampling does.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from tqdm import tqdm

from tinyvllm.engine.engine import Engine
from tinyvllm.engine.engine_config import EngineConfig, with_speculative_config
from tinyvllm.engine.sampling import Logprob, SamplingParams
from tinyvllm.engine.sequence import Sequence, Status
from tinyvllm.errors import TinyVLLMError


@dataclass
class CompletionOutput:
    index: int = 0                    # which of the request's n samples
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (stop token or string), "length" (max_tokens / context), "error"
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the sampled and top tokens (if asked)


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]   # one per sample (SamplingParams.n)
    timings: dict[str, float] = field(default_factory=dict)  # of the first sample: time to first token, ...

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


class LLM:
    """llm.engine is the engine (scheduler, KV pool, step loop); llm.model the model it runs."""

    def __init__(self, model: str = "default", speculative_config: dict | None = None, **settings):
        """model: 'default', a synthetic preset or a HF model directory; settings: any EngineConfig field
        (device, max_model_len, num_blocks, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
        enable_prefix_caching, enforce_eager, async_scheduling, batch_invariant, long_prefill_token_threshold,
        speculative_method, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, num_draft_layers,
        speculative_model), as in vLLM;
        speculative_config: vLLM's dict for the speculative ones, e.g. {"method": "ngram", "num_speculative_tokens": 4}."""
        unknown = sorted(set(settings) - set(EngineConfig.names()))
        if unknown:
            raise TinyVLLMError(f"LLM() got unknown settings {unknown}; the settings are {EngineConfig.names()[1:]}")
        self._start(EngineConfig(model=model, **with_speculative_config(settings, speculative_config)))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = Engine.from_config(config)
        self.model, self.tokenizer = self.engine.model, self.engine.tokenizer
        self.model_config, self.model_dir = self.model.cfg, self.model.model_dir
        self.device, self.max_model_len = self.engine.config.device, self.engine.max_model_len
        self.stop_token_ids = sorted(self.engine.stop_ids)

    def close(self) -> None:
        """Free the weights, the buffers, the KV cache pool and the CUDA graphs now; closing twice is harmless.

        `del llm` frees them too, but on a GPU CuPy keeps freed memory in its pool for this process's next
        arrays; close() also hands that back to the driver. Using the LLM afterwards raises TinyVLLMError."""
        if self.engine is None:
            return
        engine, self.engine = self.engine, None
        self.model = None   # the engine holds the only other references to the model, pool and graphs
        engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.engine is None:
            raise TinyVLLMError("this LLM is closed (close() freed its model and KV cache); create a new LLM")

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Complete raw prompts (text, or token id lists) all together; outputs in input order."""
        self._check_open()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run_all(texts, ids, sampling_params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the chat template to one conversation (or a list of them) and generate the replies."""
        self._check_open()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self._run_all([None] * len(ids), ids, sampling_params, use_tqdm)

    def _run_all(self, texts: list[str | None], ids: list[list[int]], params, use_tqdm: bool = False):
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(ids)
        if len(params) != len(ids):
            raise TinyVLLMError(f"{len(ids)} prompts but {len(params)} SamplingParams; give one, or one per prompt")
        for prompt in ids:  # all checked before any is queued: a bad one leaves nothing behind in the engine
            self.engine.check_prompt(prompt)
        samples = [[self.add_request(i, p.child(0), stream=False)] for i, p in zip(ids, params)]
        later = [k for k, p in enumerate(params) if p.n > 1]  # requests whose other samples are still to add
        with tqdm(total=sum(p.n for p in params), desc="generating", unit="seq", disable=not use_tqdm) as bar:
            while later or self.engine.has_work():
                later = self._add_siblings(samples, ids, params, later)
                for seq, _ in self.engine.step():
                    bar.update(seq.status is Status.FINISHED)
        return [_output(t, s) for t, s in zip(texts, samples)]

    def _add_siblings(self, samples: list[list[Sequence]], ids: list[list[int]], params: list[SamplingParams],
                      later: list[int]) -> list[int]:
        """Add samples 1 .. n-1 of each request in `later`; with prefix caching, only once sample 0 has been
        prefilled, so they find the prompt's blocks cached and share them. Returns the requests still waiting."""
        ready = [k for k in later if not self.engine.config.enable_prefix_caching or samples[k][0].output_ids
                 or samples[k][0].status is Status.FINISHED]
        for k in ready:
            samples[k] += [self.add_request(ids[k], params[k].child(i), stream=False) for i in range(1, params[k].n)]
        return [k for k in later if k not in ready]

    def add_request(self, prompt_ids: list[int], params: SamplingParams, stream: bool = True,
                    detokenize: bool = True) -> Sequence:
        """Queue one sample in the engine (params.n must be 1: use params.child(i) for each sample),
        the prompt checked first: an impossible one is refused before it starts."""
        self._check_open()
        return self.engine.add_request(prompt_ids, params, stream, detokenize)

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               out: RequestOutput | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as soon as it is complete UTF-8 and past any stop string.
        Other requests in the engine advance too; closing the iterator early aborts this one."""
        seq = self.add_request(prompt_ids, params)
        try:
            while seq.status is not Status.FINISHED:
                self._check_open()  # close() between two chunks ends the stream
                for s, text in self.engine.step():
                    if s is seq and text:
                        yield text
        finally:
            if seq.status is not Status.FINISHED and self.engine is not None:
                self.engine.abort(seq)
            if out is not None:
                out.outputs[0], out.timings = _completion(0, seq), seq.metrics()


def _completion(index: int, seq: Sequence) -> CompletionOutput:
    return CompletionOutput(index, seq.text, list(seq.output_ids), seq.finish_reason,
                            None if seq.logprobs is None else list(seq.logprobs))


def _output(prompt: str | None, samples: list[Sequence]) -> RequestOutput:
    return RequestOutput(prompt, samples[0].prompt_ids, [_completion(i, s) for i, s in enumerate(samples)],
                         samples[0].metrics())
