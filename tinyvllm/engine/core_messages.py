"""Chapter 7: the messages between the API side and the engine core (engine_core.py), and how they travel.

    API server --- commands: Add(request), Abort(request id), Snapshot(), None (shut down) ---> engine core
    API server <-- one Report per step: an Update per request that got something, the Stats -- engine core

Named tuples, pickled onto two ZeroMQ sockets; a Report's Updates go as plain tuples (report_bytes).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import NamedTuple

from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.engine.step_record import StepRecord


class Add(NamedTuple):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    after: str | None = None          # sample 0 of the same prompt (n > 1): with prefix caching, start once
                                      # it is prefilled, so this sample finds the prompt's blocks cached


class Abort(NamedTuple):
    request_id: str


class Snapshot(NamedTuple):
    """Ask for the pool and the queues as they are after the next step (the live page; at most 4 a second)."""


class Update(NamedTuple):
    """What one request got in one step."""
    request_id: str
    token_ids: list[int]              # new tokens since the last Update
    logprobs: list | None             # one {token id: Logprob} per new token, if the request asked
    text: str | None                  # new text, only when the engine detokenizes (stop strings)
    finish_reason: str | None         # "stop", "length", "abort" or "error" once it is finished
    error: str | None = None          # why it failed ("error" finish), one line


@dataclass
class Stats:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    num_blocks: int = 0
    steps: int = 0
    prefix_cache_queries: int = 0     # prompt tokens admitted so far (recomputed ones included)
    prefix_cache_hits: int = 0        # of which found in the prefix cache, not computed
    spec_decode_num_drafts: int = 0           # speculative decoding (chapter 10): verifications so far
    spec_decode_num_draft_tokens: int = 0     # tokens proposed
    spec_decode_num_accepted_tokens: int = 0  # of which kept
    spec_decode_accepted_per_position: tuple[int, ...] = ()  # kept at each position of the proposals


class Report(NamedTuple):
    updates: list[Update]
    stats: Stats
    step: StepRecord | None           # who prefilled, decoded, was preempted (request ids), for the chapter's plots
    snapshot: dict | None = None      # the pool and the queues, only when a Snapshot was asked for
    tokens: int = 0                   # new tokens this step, every API-server process's requests together


def report_bytes(report: Report) -> bytes:
    """A Report for the socket, its Updates as plain tuples: pickle spends ~5x longer on a named tuple than on
    a plain one (128 Updates: 128 us against 23 us on a 2-core CPU), and the engine core pickles a Report every
    step, in the loop's own time."""
    return pickle.dumps(report._replace(updates=[tuple(u) for u in report.updates]), pickle.HIGHEST_PROTOCOL)


def report_from(data: bytes) -> Report | tuple:
    """report_bytes undone, on the API side; any other message (("closed",)) as it was sent."""
    message = pickle.loads(data)
    if isinstance(message, Report):
        return message._replace(updates=[Update(*u) for u in message.updates])
    return message


def one_line(e: BaseException) -> str:
    """An exception as a message carries it (Update.error, a failed start): its first line, or its type's name."""
    return (str(e) or type(e).__name__).splitlines()[0]
