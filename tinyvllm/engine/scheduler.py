"""Chapter 7: the scheduler — which sequences run in the next step, and the blocks they run in.

The scheduler owns the block manager. Each step it answers two questions, in this order:
  1. Can every running sequence decode one more token? Each may need a new block. When the pool is
     empty, the YOUNGEST running sequence is preempted: its blocks go back to the pool and it goes to
     the front of the queue, to be recomputed from its tokens (prompt + output so far) later.
  2. Which waiting sequences start now? In arrival order (FIFO: nobody is overtaken), while there is a
     free slot (max_num_seqs), room in the step's token budget (max_num_batched_tokens) and blocks
     for the prompt. The first that does not fit stops admission, so a long prompt is not starved.
Then it takes the blocks it promised and hands the model a plan (tinyvllm/model/step_plan.py): per
sequence, the tokens to compute, their positions, their slots and its block table. The model only reads
the plan. A finished sequence leaves the running set (and its blocks the pool) before the next step is
planned, so its slot is refilled in that very step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinyvllm.engine import block_manager
from tinyvllm.engine.block_manager import plan_decode, plan_prefill
from tinyvllm.engine.sequence import Sequence, Status
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.kv_pool import BLOCK_SIZE
from tinyvllm.model.step_plan import StepPlan


@dataclass
class Step:
    prefills: list[Sequence] = field(default_factory=list)   # admitted now: their tokens go through prefill
    decodes: list[Sequence] = field(default_factory=list)    # running: one token each
    preempted: list[Sequence] = field(default_factory=list)
    plan: StepPlan = field(default_factory=StepPlan)         # what the model computes: prefills, then decodes


class Scheduler:
    def __init__(self, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = False):
        if prefix_caching:  # full blocks named by hash, shared between prompts
            from tinyvllm.engine.prefix_cache import PrefixCachingBlockManager
            self.blocks = PrefixCachingBlockManager(num_blocks)
        else:
            self.blocks = block_manager.BlockManager(num_blocks)  # through the module: Exercise 6.1 plugs in here
        self.prefix_caching = prefix_caching
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []        # in admission order: the last one is the youngest

    def add(self, seq: Sequence) -> None:
        if len(seq) > self.max_num_batched_tokens:
            raise TinyVLLMError(f"the prompt has {len(seq)} tokens; a step takes at most "
                                f"{self.max_num_batched_tokens} (max_num_batched_tokens)")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """Decide who runs, then take their blocks: the returned step carries the model's plan."""
        step = self.decide()
        self.allocate(step)
        return step

    def decide(self) -> Step:
        """Who runs this step: decodes first (preempting the youngest while blocks are short), then
        admissions. Decided on counts of free blocks; no new block is taken yet (an admitted prompt only
        shares its cached prefix blocks)."""
        step, free = Step(), self.blocks.num_free      # free: blocks not yet promised to anyone this step
        for seq in list(self.running):                 # oldest first: the oldest are the last to be preempted
            if seq.status is not Status.RUNNING:
                continue                               # preempted a moment ago for an older sequence
            need = self.blocks.blocks_to_append(seq.seq_id)
            while need > free and seq.status is Status.RUNNING:
                victim = choose_victim(self.running)   # the youngest (perhaps seq itself)
                if victim in step.decodes:
                    raise TinyVLLMError(f"choose_victim returned sequence {victim.seq_id}, which already decodes "
                                        "in this step; return the youngest running sequence, running[-1]")
                free += self._preempt(victim)
                step.preempted.append(victim)
            if seq.status is Status.RUNNING:
                free -= need
                step.decodes.append(seq)
        if not step.preempted:                         # the pool just ran dry: admit nobody this step
            admit(self, step, free)
        return step

    def allocate(self, step: Step) -> None:
        """Take the blocks decide() promised and write the plan: the model gets slots and tables, never
        the block manager. Prefills first (each prompt's uncached tail), then one slot per decode."""
        step.plan = StepPlan([plan_prefill(self.blocks, s.seq_id, s.token_ids, s.num_cached) for s in step.prefills],
                             plan_decode(self.blocks, [s.seq_id for s in step.decodes], [s.last_token for s in step.decodes]))

    def _preempt(self, seq: Sequence) -> int:
        """Preemption by recompute: free everything now, redo the prefill of all its tokens later.
        Returns how many blocks came free."""
        before = self.blocks.num_free
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status, seq.preemptions = Status.WAITING, seq.preemptions + 1
        self.waiting.appendleft(seq)
        return self.blocks.num_free - before

    def update(self, seq: Sequence, prefilled: bool) -> None:
        """After a step gave seq a token: name its newly full blocks (prefix caching), retire it if finished."""
        if self.prefix_caching and (prefilled or self.blocks.lengths[seq.seq_id] % BLOCK_SIZE == 0):
            self.blocks.cache_full_blocks(seq.seq_id, seq.token_ids)
        if seq.status is Status.FINISHED:
            self.finish(seq)

    def finish(self, seq: Sequence) -> None:
        """A finished (or aborted) sequence gives its slot and its blocks back at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED


# The two decisions, as module-level functions (chapter 7's exercises replace them)

def admit(scheduler: Scheduler, step: Step, free: int) -> None:
    """Move waiting sequences to running, in arrival order, while each fits: a free slot (max_num_seqs),
    room in the step's token budget, and `free` blocks (those not yet promised this step). Each one
    admitted goes into step.prefills; the first that does not fit ends admission (FIFO)."""
    budget = scheduler.max_num_batched_tokens
    while scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
        seq = scheduler.waiting[0]
        need = scheduler.blocks.blocks_to_admit(seq.token_ids)
        if len(seq) > budget or need > free:
            break                                      # the head waits for room, nobody overtakes it
        scheduler.waiting.popleft()
        seq.status, free = Status.RUNNING, free - need
        seq.num_cached = scheduler.blocks.admit(seq.seq_id, seq.token_ids)  # prefix-cache hit, in tokens
        budget -= len(seq) - seq.num_cached
        scheduler.running.append(seq)
        step.prefills.append(seq)


def choose_victim(running: list[Sequence]) -> Sequence:
    """Which running sequence to preempt: the youngest (admitted last) — it has the least work to redo
    and the oldest keep their place, so every sequence eventually finishes."""
    return running[-1]
