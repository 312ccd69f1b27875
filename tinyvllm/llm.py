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

import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from tqdm import tqdm

from tinyvllm.backend import resolve_device
from tinyvllm.block_manager import BLOCK_SIZE
from tinyvllm.config import load_config
from tinyvllm.engine import Engine
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model import Model
from tinyvllm.models import resolve_model
from tinyvllm.paged_cache import PagedKVCache, pool_blocks
from tinyvllm.sampling import Logprob, SamplingParams
from tinyvllm.sequence import Sequence, Status, check_prompt
from tinyvllm.tokenizer import load_tokenizer

# Tokens the prefill buffers hold (float32 on the CPU: ~32 KB per token for SmolLM2; bf16 on the GPU).
MAX_PREFILL_TOKENS = {"cpu": 4096, "cuda": 8192}


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
    def __init__(self, model: str = "default", device: str = "auto", max_model_len: int | None = None,
                 num_blocks: int | None = None, gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = False,
                 enforce_eager: bool = False):
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
        self.cache = PagedKVCache(self.config, self.engine.ops, blocks, prefix_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        if blocks * BLOCK_SIZE < self.max_model_len:  # one sequence must fit the pool: never refuse a request later
            logging.getLogger("tinyvllm").info("max_model_len lowered from %d to %d: what the KV cache pool of %d "
                                               "blocks holds", self.max_model_len, blocks * BLOCK_SIZE, blocks)
            self.max_model_len = blocks * BLOCK_SIZE
        decode = None
        if self.device == "cuda" and not enforce_eager:  # chapter 7: decode steps replayed from CUDA graphs
            from tinyvllm.cuda_graphs import GraphedDecode
            decode = GraphedDecode(self.engine, self.cache, min(max_num_seqs, self.engine.max_tokens))
        self.llm_engine = Engine(self.engine, self.tokenizer, self.cache, set(self.stop_token_ids), max_num_seqs,
                                 max_num_batched_tokens, decode, self.max_model_len)

    def close(self) -> None:
        """Free the weights, the buffers, the KV cache pool and the CUDA graphs now; closing twice is harmless.

        `del llm` frees them too, but on a GPU CuPy keeps freed memory in its pool for this process's next
        arrays; close() also hands that back to the driver. Using the LLM afterwards raises TinyVLLMError."""
        if self.llm_engine is None:
            return
        ops = self.engine.ops
        self.engine = self.cache = self.llm_engine = None  # the only references to the model, pool and graphs
        gc.collect()  # an array caught in a reference cycle goes only when the collector runs: run it now
        ops.free_cached_memory()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.llm_engine is None:
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
            self._check_prompt(prompt)
        samples = [[self.add_request(i, p.child(0), stream=False)] for i, p in zip(ids, params)]
        later = [k for k, p in enumerate(params) if p.n > 1]  # requests whose other samples are still to add
        with tqdm(total=sum(p.n for p in params), desc="generating", unit="seq", disable=not use_tqdm) as bar:
            while later or self.llm_engine.has_work():
                later = self._add_siblings(samples, ids, params, later)
                for seq, _ in self.llm_engine.step():
                    bar.update(seq.status is Status.FINISHED)
        return [_output(t, s) for t, s in zip(texts, samples)]

    def _add_siblings(self, samples: list[list[Sequence]], ids: list[list[int]], params: list[SamplingParams],
                      later: list[int]) -> list[int]:
        """Add samples 1 .. n-1 of each request in `later`; with prefix caching, only once sample 0 has been
        prefilled, so they find the prompt's blocks cached and share them. Returns the requests still waiting."""
        ready = [k for k in later if not self.enable_prefix_caching or samples[k][0].output_ids
                 or samples[k][0].status is Status.FINISHED]
        for k in ready:
            samples[k] += [self.add_request(ids[k], params[k].child(i), stream=False) for i in range(1, params[k].n)]
        return [k for k in later if k not in ready]

    def add_request(self, prompt_ids: list[int], params: SamplingParams, stream: bool = True,
                    detokenize: bool = True) -> Sequence:
        """Queue one sample in the engine (params.n must be 1: use params.child(i) for each sample),
        the prompt checked first: an impossible one is refused before it starts."""
        self._check_open()
        self._check_prompt(prompt_ids)
        return self.llm_engine.add_request(prompt_ids, params, stream, detokenize)

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               out: RequestOutput | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as soon as it is complete UTF-8 and past any stop string.
        Other requests in the engine advance too; closing the iterator early aborts this one."""
        seq = self.add_request(prompt_ids, params)
        try:
            while seq.status is not Status.FINISHED:
                self._check_open()  # close() between two chunks ends the stream
                for s, text in self.llm_engine.step():
                    if s is seq and text:
                        yield text
        finally:
            if seq.status is not Status.FINISHED and self.llm_engine is not None:
                self.llm_engine.abort(seq)
            if out is not None:
                out.outputs[0], out.timings = _completion(0, seq), seq.metrics()

    def _check_prompt(self, ids: list[int]) -> None:
        check_prompt(ids, self.max_model_len, self.engine.max_tokens, self.config.vocab_size, self.device)


def _completion(index: int, seq: Sequence) -> CompletionOutput:
    return CompletionOutput(index, seq.text, list(seq.output_ids), seq.finish_reason,
                            None if seq.logprobs is None else list(seq.logprobs))


def _output(prompt: str | None, samples: list[Sequence]) -> RequestOutput:
    return RequestOutput(prompt, samples[0].prompt_ids, [_completion(i, s) for i, s in enumerate(samples)],
                         samples[0].metrics())
