"""Chapter 7: one request as the scheduler sees it — its tokens, its sampling state, its text so far.

A sequence is WAITING (queued, or preempted and queued again), RUNNING (its prompt goes through prefill,
in chunks if the step's token budget is smaller, then it decodes one token per step) or FINISHED. Its text is built token by token: complete UTF-8 only, and
never past a stop string (the last few characters are held back until they cannot start one).
A structured output's Matcher (chapter 11) moves on every token and sets the mask of the next one; once the
output is complete and only a stop token could follow, the sequence stops there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from tinyvllm.engine.sampling import Logprob, SamplingParams, rng_for
from tinyvllm.engine.structured.token_dfa import Matcher, TokenDFA
from tinyvllm.engine.structured.token_pda import TokenPDA
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.tokenizer import IncrementalDecoder, Tokenizer
from tinyvllm.model.step_plan import Sampling


class PromptTooLong(TinyVLLMError):
    """A prompt past the context window (the server's context_length_exceeded)."""


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Refuse a prompt the engine cannot run, before it is queued: one line saying why."""
    if not ids:
        raise TinyVLLMError("the prompt is empty; give at least one token")
    if len(ids) >= max_model_len:
        raise PromptTooLong(f"the prompt has {len(ids)} tokens but the context window is {max_model_len}; "
                            "shorten the prompt")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise TinyVLLMError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: `seq in running` must not compare every field of 256 sequences
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int                    # params.max_tokens, capped by the context window
    stop_ids: set[int]
    decoder: IncrementalDecoder
    output_ids: list[int] = field(default_factory=list)
    text: str = ""                     # released text: complete characters, no stop string
    held: str = ""                     # decoded but held back: it may be the start of a stop string
    status: Status = Status.WAITING
    finish_reason: str | None = None   # "stop", "length", or "error" (then `error` says why)
    error: str | None = None           # one line, when sampling or bookkeeping failed for this sequence
    logprobs: list[dict[int, Logprob]] | None = None  # one entry per output token, if params.logprobs asked
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    num_cached: int = 0                # tokens found in the prefix cache when it was last admitted
    num_computed: int = 0              # tokens whose K/V are in the pool (cached ones included)
    pending: int = 0                   # tokens drawn by launched steps, not yet appended (async scheduling: up to 2)
    block_hashes: list[int] = field(default_factory=list)  # prefix caching: its full blocks' chained hashes
    incremental: bool = True           # text token by token (streaming, stop strings); else once, at the end
    detokenize: bool = True            # False: no text at all (the server's API process decodes the ids)
    matcher: Matcher | None = None     # structured outputs: where the output is in its automaton

    def __post_init__(self):
        self.rng = rng_for(self.params.seed)  # its own generator: a seed means the same tokens
        # what the plan tells the model runner when this sequence samples: the same lists, read in place
        self.sampling = Sampling(self.params, self.rng, self.prompt_ids, self.output_ids,
                                 None if self.matcher is None else self.matcher.allowed())

    @classmethod
    def create(cls, seq_id: int, prompt_ids: list[int], params: SamplingParams, max_model_len: int,
               stop_ids: set[int], tokenizer: Tokenizer, incremental: bool = True,
               detokenize: bool = True, constraint: TokenDFA | TokenPDA | None = None) -> Sequence:
        """constraint: the compiled structured output the tokens must follow (None: free text)."""
        room = max_model_len - len(prompt_ids)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else stop_ids)
        return cls(seq_id, list(prompt_ids), params, min(params.max_tokens or room, room), stops,
                   IncrementalDecoder(tokenizer), incremental=incremental or bool(params.stop),
                   detokenize=detokenize, logprobs=None if params.logprobs is None else [],
                   matcher=None if constraint is None else Matcher(constraint, stops))

    @property
    def token_ids(self) -> list[int]:
        """Everything the model has seen or produced: what a preempted sequence recomputes."""
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """The newest token, the one decode feeds in (without building token_ids: 256 of them per step)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def decoding(self) -> bool:
        """All its K/V are in the pool but the newest token's (perhaps still on its way: pending): the next step
        computes one token."""
        return self.num_computed == len(self) + self.pending - 1

    def append(self, token: int, logprobs: dict[int, Logprob] | None = None) -> str:
        """Record a sampled token (and its logprobs, if asked for); returns the text it releases (possibly "").
        Sets finish_reason when done."""
        now = time.perf_counter()
        self.first_token_time = self.first_token_time or now
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        self.output_ids.append(token)
        complete = self._follow(token)
        if not self.incremental:                       # the text is decoded once, when the sequence ends
            if token in self.stop_ids or complete or len(self.output_ids) >= self.max_tokens:
                ids = self.output_ids[:-1] if token in self.stop_ids else self.output_ids
                reason = "stop" if token in self.stop_ids or complete else "length"
                return self._finish(reason, self.decoder.tokenizer.decode(ids) if self.detokenize else "", now)
            return ""
        if token in self.stop_ids:                     # a stop token ends the output and is not text
            return self._finish("stop", self.held + self.decoder.flush(), now)
        self.held += self.decoder.feed(token)
        cut = min((i for i in (self.held.find(s) for s in self.params.stop) if i >= 0), default=-1)
        if cut >= 0:                                   # a stop string ends the text exactly where it begins
            return self._finish("stop", self.held[:cut], now)
        if complete:                                   # the structured output is whole: nothing may follow
            return self._finish("stop", self.held + self.decoder.flush(), now)
        if len(self.output_ids) >= self.max_tokens:
            return self._finish("length", self.held + self.decoder.flush(), now)
        hold = max((len(s) for s in self.params.stop), default=1) - 1  # chars that may start a stop string
        ready, self.held = self.held[:max(len(self.held) - hold, 0)], self.held[max(len(self.held) - hold, 0):]
        self.text += ready
        return ready

    def _follow(self, token: int) -> bool:
        """Structured outputs: move the matcher past the token and set the next step's mask. True when the
        output is complete and only a stop token could follow (the sequence stops without sampling it)."""
        if self.matcher is None or token in self.stop_ids:
            return False
        self.matcher.advance(token)
        if self.matcher.must_stop():
            return True
        self.sampling.allowed = self.matcher.allowed()
        return False

    def fail(self, error: str) -> None:
        """End this sequence alone after a failure: finish_reason "error", the text held back is dropped."""
        self.error = error
        self._finish("error", "", time.perf_counter())

    def _finish(self, reason: str, rest: str, now: float) -> str:
        self.finish_reason, self.status, self.finish_time, self.held = reason, Status.FINISHED, now, ""
        self.text += rest
        return rest

    def metrics(self) -> dict[str, float]:
        """Seconds to the first token, and per output token after it (vLLM's TTFT and TPOT)."""
        ttft = (self.first_token_time or self.arrival_time) - self.arrival_time
        after = len(self.output_ids) - 1
        tpot = (self.finish_time - self.first_token_time) / after if after > 0 and self.finish_time else 0.0
        return {"time_to_first_token_s": ttft, "time_per_output_token_s": tpot,
                "decode_tokens_per_s": 1 / tpot if tpot else 0.0, "preemptions": self.preemptions}
