"""Chapter 7: one step as it ran — the record the engine keeps, the engine core sends and the live page draws.

Its own small module: the API side unpickles it without importing the engine (which imports the model).
"""
from __future__ import annotations

from typing import NamedTuple


class StepRecord(NamedTuple):
    """One step as it ran, for plots, tests and the live page: the engine's trace keeps the last TRACE_STEPS.
    The engine core renames the sequence ids to request ids; the API side stamps when the report arrived."""
    step: int
    prefill: list           # sequences whose prompt (or a chunk of it) ran, in the step's order
    chunks: list[int]       # tokens each of them computed
    decode: list            # sequences that decoded one token
    preempted: list         # sequences preempted to make room
    free_blocks: int        # blocks free after the step
    proposed: list[int] = []  # per decoding sequence, the tokens it verified (chapter 10; 0: a plain decode)
    time: float | None = None
