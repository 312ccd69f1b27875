"""Chapter 10 exercises: the four pieces of speculative decoding, in NumPy and plain lists, graded on the CPU.

Fill them in, then:

    make grade CH=10                  # the graders: a score table
    make chapter-10 IMPL=student      # the chapter's checkpoint, with your functions inside the engine
    .venv/bin/python -m pytest tests/test_ch10_exercises.py --impl=student -x
                                      # the graders alone: the first failure, with its traceback

`--impl student` replaces the functions of chapters/ch10_speculative/speculative.py with yours; the
checkpoint then runs the engine with your proposer (10.1) making its guesses, your acceptance rule (10.2)
deciding what a greedy verification emits, and your rollback (10.4) giving back the blocks of rejected
guesses, and checks your rejection sampling (10.3) against the target distribution.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.errors import TinyVLLMError  # noqa: F401  (for your solution)
from tinyvllm.model.step_plan import BLOCK_SIZE

REFERENCE = {
    "propose_ngram": "chapters.ch10_speculative.speculative:propose_ngram",
    "accept_greedy": "chapters.ch10_speculative.speculative:accept_greedy",
    "rejection_sample": "chapters.ch10_speculative.speculative:rejection_sample",
    "rollback_block_table": "chapters.ch10_speculative.speculative:rollback_block_table",
}


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: guess the next tokens of a sequence from its own past.

    Exercise 10.1. `tokens` is the whole sequence so far (prompt, then output). For n = max_n, max_n - 1, ...,
    min_n (longest first; never more than len(tokens) - 1), look for the last n tokens, tokens[-n:], earlier
    in the sequence: a window tokens[i:i + n] equal to them that has at least one token after it (i + n <
    len(tokens), so the suffix itself does not count). At the first n with a match, take the MOST RECENT
    match (the largest i) and return the up to k tokens that followed it, tokens[i + n:i + n + k] (fewer
    near the end). No match at any n: return []. Return a list of Python ints.

    Example: tokens [1, 2, 3, 9, 1, 2], k=3, min_n=1, max_n=2: the suffix [1, 2] occurs at i=0; what
    followed is [3, 9, 1].
    """
    raise NotImplementedError("Exercise 10.1: propose_ngram")


def accept_greedy(proposals: list[int], target: list[int]) -> list[int]:
    """What one greedy verification emits.

    Exercise 10.2. The model checked the k = len(proposals) guesses in one pass: target[j] is its argmax at
    position j, i.e. the token greedy decoding emits after the sequence plus proposals[:j] (target has
    k + 1 entries: the last is what comes after all k guesses). Keep proposals[0], proposals[1], ... while
    each equals the target's token at its position; at the first j where proposals[j] != target[j], emit
    target[j] instead and stop; if all k are kept, emit target[k] too (the bonus token). So the result is
    target[:m + 1], with m the number of guesses kept: 1 to k + 1 tokens, always a prefix of what plain
    greedy decoding emits. Raise TinyVLLMError (one line) if len(target) != k + 1.
    """
    raise NotImplementedError("Exercise 10.2: accept_greedy")


def rejection_sample(p: np.ndarray, q: np.ndarray, x: int, rng: np.random.Generator) -> tuple[int, bool]:
    """The rejection-sampling rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023), for one
    position.

    Exercise 10.3. p and q are float64 probability vectors over the vocabulary (each sums to 1): p the
    target model's distribution at this position, q the draft's. The draft drew its guess x from q, so
    q[x] > 0. Draw u = rng.random(); if u < min(1, p[x] / q[x]), keep x: return (x, True). Otherwise draw
    the token from the residual distribution max(0, p - q), normalized to sum to 1 (rng.choice(len(p),
    p=...) does it), and return (that token, False). The emitted token is then distributed exactly as p:
    the graders count thousands of draws and test that with a chi-square test, and check how often x is
    kept. Use only `rng` for randomness (no np.random.* functions, no new generators).
    """
    raise NotImplementedError("Exercise 10.3: rejection_sample")


def rollback_block_table(table: list[int], length: int, drop: int,
                         block_size: int = BLOCK_SIZE) -> tuple[list[int], list[int]]:
    """Drop the K/V of rejected guesses: the block table after the last `drop` tokens go.

    Exercise 10.4. `table` is a sequence's block table (chapter 6): its tokens 0 .. length - 1 live in
    blocks table[0], table[1], ..., block_size tokens to a block, so len(table) is ceil(length /
    block_size). After dropping its last `drop` tokens it holds length - drop tokens. Return (new_table,
    freed): new_table the first ceil((length - drop) / block_size) blocks of the table (a new list; the
    given one unchanged), freed the blocks after them, in table order (they go back to the free list). A
    block still partly used stays: the slots of dropped tokens in it are simply written again later.
    Raise TinyVLLMError (one line) if drop is not in 0 .. length, or if len(table) does not match length.
    """
    raise NotImplementedError("Exercise 10.4: rollback_block_table")
