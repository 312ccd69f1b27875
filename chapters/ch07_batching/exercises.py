"""Chapter 7 exercises: the scheduler's two decisions — who starts now, and who makes room.

Both are plain Python on the host and graded on the CPU with a fake block manager (no model), then
inside the real engine on a tiny random model. Fill them in, then:

    make grade CH=7                   # the graders: a score table
    make chapter-7 IMPL=student       # the chapter's checkpoint, with your admit and choose_victim
                                      # inside the engine's Scheduler
    .venv/bin/python -m pytest tests/test_ch07_exercises.py --impl=student -x
                                      # the graders alone: the first failure, with its traceback

`--impl student` replaces tinyvllm.engine.scheduler.admit and tinyvllm.engine.scheduler.choose_victim with yours;
Scheduler.decide calls them through the module, so every step of the engine then runs your code. Both
decide on counts: no block leaves the free list until Scheduler.allocate writes the step's plan.
"""
from __future__ import annotations

from tinyvllm.engine.scheduler import Scheduler, Step
from tinyvllm.engine.sequence import Sequence, Status  # noqa: F401  (for your solution)

REFERENCE = {
    "admit": "tinyvllm.engine.scheduler:admit",
    "choose_victim": "tinyvllm.engine.scheduler:choose_victim",
}


def admit(scheduler: Scheduler, step: Step, free: int, budget: int) -> None:
    """Move waiting sequences to running, in arrival order, while each fits: a free slot (max_num_seqs),
    tokens left in the step's budget, and `free` blocks (those not yet promised this step). A sequence
    computes what its cached prefix does not hold, as much of it as the budget allows and at most
    scheduler.long_prefill_token_threshold tokens (a chunk; the rest follows in the next steps). Each one
    admitted goes into step.prefills, its token count into step.chunks; the first that does not fit ends
    admission (FIFO).

    Exercise 7.1. Scheduler.decide calls this last: the running sequences have been promised their decode
    token and blocks, and a prompt started in an earlier step its next chunk (promised, not taken:
    Scheduler.allocate takes the blocks once decide is done). What you may use:
      scheduler.waiting                 a collections.deque of Sequence, the next one on the LEFT
      scheduler.running                 a list of Sequence, in admission order (append to it)
      scheduler.max_num_seqs            how many sequences may run at once (running included)
      scheduler.long_prefill_token_threshold  the most tokens one prompt may compute in a step, so that
                                        a long prompt leaves budget for the short ones behind it
      scheduler.block_manager           the block manager:
          hit = block_manager.lookup(seq) -> PrefixHit     the blocks of seq's cached prefix (prefix caching;
                                                           none without it); hit.tokens: the leading tokens
                                                           they hold, which cost no budget. Once per admission
          block_manager.blocks_to_admit(hit, num_tokens)   free blocks the first num_tokens tokens of the new
                                                           sequence take (the hit's shared blocks excepted)
          block_manager.admit(seq.seq_id, hit) -> int      start it on the hit's blocks; returns how many of
                                                           its tokens they hold
      free                              free blocks NOT yet promised this step: use it, not
                                        block_manager.num_free (it still counts what the decodes were promised)
      budget                            tokens this step may still compute (the decodes and a started
                                        prompt's chunk already took theirs)

    The rules, for the sequence at the head of the queue, waiting[0]:
      - it computes the tokens of seq.token_ids (prompt AND output: a preempted one recomputes what it
        had generated) that its cached prefix does not hold, or as many of them as `budget` and
        scheduler.long_prefill_token_threshold allow (a chunk). Cached tokens cost no budget;
      - it fits if a slot is free (max_num_seqs counts the running ones), budget is left, and the blocks
        it takes are at most `free`: blocks_to_admit of its tokens from the first to the chunk's last
        (the cached ones and the chunk);
      - one that fits leaves the queue and runs: status RUNNING, block_manager.admit called for it exactly
        once, whose answer is both seq.num_cached and seq.num_computed (both, every time: a preempted sequence
        starts over); it goes to the end of scheduler.running and of step.prefills, its chunk's size to
        step.chunks; its blocks and tokens are no longer there for the sequences behind it;
      - the first that does not fit ends admission: it stays at the head, untouched (no block_manager.admit),
        and nobody behind it is admitted even if they would fit (nobody is overtaken, so a long prompt is
        not starved by a stream of short ones).
    Return nothing.
    """
    raise NotImplementedError("Exercise 7.1: admit")


def choose_victim(running: list[Sequence]) -> Sequence:
    """Which running sequence to preempt: the youngest (admitted last) — it has the least work to redo
    and the oldest keep their place, so every sequence eventually finishes.

    Exercise 7.2. `running` is the scheduler's list of running sequences in admission order: the first
    was admitted earliest (a sequence preempted and admitted again goes to the end, like any new one).
    Return the youngest one; do not change the list (the scheduler removes the victim itself, frees its
    blocks and puts it at the front of the waiting queue, to be recomputed from its tokens later).
    It may be the very sequence that asked for a block: then that one waits, and the older ones go on.
    """
    raise NotImplementedError("Exercise 7.2: choose_victim")
