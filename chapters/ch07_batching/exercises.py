"""Chapter 7 exercises: the scheduler's two decisions — who starts now, and who makes room.

Both are plain Python on the host and graded on the CPU with a fake block manager (no model), then
inside the real engine on a tiny random model. Fill them in, then:

    make grade CH=7                   # pytest -m ch7 --impl=student: the graders
    make chapter-7 IMPL=student       # the chapter's checkpoint, with your admit and choose_victim
                                      # inside the engine's Scheduler

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


def admit(scheduler: Scheduler, step: Step, free: int) -> None:
    """Move waiting sequences to running, in arrival order, while each fits: a free slot (max_num_seqs),
    room in the step's token budget, and `free` blocks (those not yet promised this step). Each one
    admitted goes into step.prefills; the first that does not fit ends admission (FIFO).

    Exercise 7.1. Scheduler.decide calls this after the running sequences have been promised their blocks
    for this step's decode (promised, not taken: Scheduler.allocate takes the step's free blocks once
    decide is done); what you may use:
      scheduler.waiting                 a collections.deque of Sequence, the next one on the LEFT
      scheduler.running                 a list of Sequence, in admission order (append to it)
      scheduler.max_num_seqs            how many sequences may run at once (running included)
      scheduler.max_num_batched_tokens  the step's token budget: tokens this step's prefill may compute
      scheduler.blocks                  the block manager:
          blocks.blocks_to_admit(seq.token_ids) -> int   free blocks this sequence would take
          blocks.admit(seq.seq_id, seq.token_ids) -> int  start it; returns how many of its tokens are
                                                          already cached (prefix caching; 0 without it)
      free                              free blocks NOT yet promised this step: use it, not
                                        blocks.num_free (it still counts the blocks promised to this
                                        step's decodes)

    Look at the sequence at the head of the queue, waiting[0]. It is admitted if
      - len(scheduler.running) < max_num_seqs,
      - len(seq) (all its tokens: a preempted one recomputes its output too) is at most what is left of
        the budget — check the whole length: how much is cached is only known once it is admitted,
      - blocks_to_admit(seq.token_ids) <= free.
    If so: pop it from the left of waiting; set seq.status = Status.RUNNING; free -= the blocks it takes;
    seq.num_cached = blocks.admit(seq.seq_id, seq.token_ids) (call admit exactly once per admitted
    sequence, never for one that is refused); only its uncached tokens use up the budget
    (len(seq) - seq.num_cached); append it to scheduler.running and to step.prefills. Then look at the
    new head. The first sequence that does not fit stops admission: it stays at the head, untouched,
    and nobody behind it is admitted even if they would fit (nobody is overtaken, so a long prompt is
    not starved by a stream of short ones). Return nothing.
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
