"""Chapter 7: the scheduler — which tokens of which sequences run in the next step, and in which blocks.

The scheduler owns the block manager. Each step has a token budget, max_num_batched_tokens (the rows of
the model's step buffers), spent in this order (vLLM v1's rule):
  1. Every running sequence that decodes gets one token. Each may need a new block; when the pool is
     empty, the YOUNGEST running sequence is preempted: its blocks go back to the pool and it goes to
     the front of the queue, to be recomputed from its tokens (prompt + output so far) later.
  2. A prompt already started (too long for one step) continues with its next chunk: as much of the rest
     as the budget left allows, and at most long_prefill_token_threshold tokens. If the pool cannot hold
     the oldest one's chunk and nothing else runs, the youngest is preempted for it (prompts part-way
     through their prefill could otherwise hold the whole pool and wait for each other forever).
  3. Waiting sequences start, in arrival order (FIFO: nobody is overtaken), while there is a free slot
     (max_num_seqs), budget left and blocks: each with as much of its prompt as the budget left allows,
     again at most long_prefill_token_threshold tokens (its cached prefix costs nothing). The first that
     does not fit stops admission.
With speculative decoding on (chapter 10), step 1 is followed by 1b: a decoding sequence for which the
proposer has guesses verifies up to num_speculative_tokens of them in the same step, from the budget and
the blocks left (a guess never preempts anyone), unless more than max_speculating_batch sequences decode (a
compute-bound step gains nothing from guesses); after the step, the blocks of rejected guesses go back.
So a prompt can be as long as the context window, and a long prompt stalls nobody: the running
sequences keep decoding while it goes through, chunk by chunk, and since one prompt takes at most
long_prefill_token_threshold tokens of a step, the rest of the budget admits the short prompts that
arrive meanwhile (vLLM's long_prefill_token_threshold: several partial prefills share a step).
Then it takes the blocks it promised and hands the model a plan (tinyvllm/model/step_plan.py): per
sequence, the tokens to compute, their positions, their slots and its block table. The model only reads
the plan. A finished sequence leaves the running set (and its blocks the pool) before the next step is
planned, so its slot is refilled in that very step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinyvllm.engine import block_manager
from tinyvllm.engine.block_manager import plan_decode, plan_prefill, plan_verify
from tinyvllm.engine.prefix_cache import PrefixCacheStats, PrefixCachingBlockManager
from tinyvllm.engine.sequence import Sequence, Status
from tinyvllm.engine.spec_decode import MIN_ACCEPTANCE, Proposer, SpeculationGate
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.step_plan import PENDING_TOKEN, StepPlan


@dataclass
class Step:
    prefills: list[Sequence] = field(default_factory=list)   # prompts (or chunks of them) through prefill
    chunks: list[int] = field(default_factory=list)          # how many tokens each of prefills computes
    decodes: list[Sequence] = field(default_factory=list)    # running: one token each
    verifies: list[Sequence] = field(default_factory=list)   # running, with proposals: their newest token and those
    proposals: list[list[int]] = field(default_factory=list) # the tokens each of verifies checks (chapter 10)
    preempted: list[Sequence] = field(default_factory=list)
    plan: StepPlan = field(default_factory=StepPlan)         # what the model computes: prefills, verifies, decodes

    @property
    def sequences(self) -> list[Sequence]:
        """Every sequence that runs, in the order of the plan's SeqSteps (plan.steps)."""
        return self.prefills + self.verifies + self.decodes


class Scheduler:
    def __init__(self, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = False, long_prefill_token_threshold: int | None = None,
                 proposer: Proposer | None = None, num_speculative_tokens: int = 0,
                 max_speculating_batch: int | None = None, min_acceptance: float = MIN_ACCEPTANCE["cpu"]):
        if prefix_caching:  # full blocks named by hash, shared between prompts
            self.block_manager = PrefixCachingBlockManager(num_blocks)
        else:
            # through the module: Exercise 6.1's class plugs in here
            self.block_manager = block_manager.BlockManager(num_blocks)
        self.prefix_caching = prefix_caching
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # the most tokens one prompt computes in a step (None: the whole budget, one prompt may fill a step)
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_num_batched_tokens
        self.proposer, self.num_speculative_tokens = proposer, num_speculative_tokens   # chapter 10 (None: off)
        self.max_speculating_batch = max_speculating_batch   # more decoding sequences: nobody proposes (None: no limit)
        self.gate = SpeculationGate(min_acceptance)   # chapter 10: who proposes, by how often its guesses are kept
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []        # in admission order: the last one is the youngest

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        """Decide who runs, then take their blocks: the returned step carries the model's plan."""
        step = self.decide()
        self.allocate(step)
        return step

    def decide(self) -> Step:
        """Who runs this step, and how many tokens each: decodes, then started prompts, then new ones.
        Decided on counts of free blocks; no new block is taken yet (an admitted prompt only shares its
        cached prefix blocks)."""
        step, free = Step(), self.block_manager.num_free  # free: blocks not yet promised to anyone this step
        for seq in list(self.running):                 # oldest first: the oldest are the last to be preempted
            if seq.status is not Status.RUNNING or not seq.decoding:
                continue                               # preempted a moment ago, or still in its prompt
            if seq.pending and len(seq.output_ids) + seq.pending >= seq.max_tokens:
                continue                               # its last token is already on its way (async scheduling)
            need = self.block_manager.blocks_to_append(seq.seq_id)
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
        budget = self.max_num_batched_tokens - len(step.decodes)
        if self.proposer is not None:                  # chapter 10: guesses from what is left
            free, budget = self.speculate(step, free, budget)
        for seq in list(self.running):                 # prompts started in an earlier step: the next chunk
            if seq.decoding or seq in step.decodes or seq.status is not Status.RUNNING:
                continue
            count = min(len(seq) - seq.num_computed, budget, self.long_prefill_token_threshold)
            need = self.block_manager.blocks_to_extend(seq.seq_id, count) if count else 0
            if need > free and not (step.decodes or step.verifies or step.prefills):
                free += self._make_room(seq, need - free, step)   # else every started prompt waits forever
            if not count or need > free or seq.status is not Status.RUNNING:
                return step                            # no room for the oldest started prompt: nobody starts
            free, budget = free - need, budget - count
            step.prefills.append(seq)
            step.chunks.append(count)
        if not step.preempted:                         # the pool just ran dry: admit nobody this step
            admit(self, step, free, budget)
        return step

    def speculate(self, step: Step, free: int, budget: int) -> tuple[int, int]:
        """Chapter 10: move each decoding sequence the proposer has guesses for from step.decodes to step.verifies,
        with as many guesses as the budget, the free blocks and its max_tokens leave room for (it emits at most
        k + 1 tokens). Oldest first; returns what is left of free and budget. A large batch proposes nothing: its
        step is compute-bound, and a guess would cost about as much as a token of its own (MAX_SPECULATING_BATCH)."""
        if self.max_speculating_batch is not None and len(step.decodes) > self.max_speculating_batch:
            return free, budget
        for seq in list(step.decodes):
            if seq.params.structured_outputs is not None:
                continue                               # its mask is for the next position only: no guesses
            if not self.gate.allows(seq.seq_id):
                continue                               # its guesses were mostly wrong: plain decoding for a while
            room = min(self.num_speculative_tokens, budget, seq.max_tokens - len(seq.output_ids) - 1)
            proposals = self.proposer.propose(seq, room)[:room] if room > 0 else []
            extra = self._extra_blocks(seq, proposals)
            while proposals and extra > free:          # fewer guesses rather than a preemption
                proposals.pop()
                extra = self._extra_blocks(seq, proposals)
            if proposals:
                step.decodes.remove(seq)
                step.verifies.append(seq)
                step.proposals.append(proposals)
                free, budget = free - extra, budget - len(proposals)
        return free, budget

    def _extra_blocks(self, seq: Sequence, proposals: list[int]) -> int:
        """Blocks that verifying `proposals` takes beyond the one decode token already counted."""
        return (self.block_manager.blocks_to_extend(seq.seq_id, 1 + len(proposals))
                - self.block_manager.blocks_to_append(seq.seq_id))

    def allocate(self, step: Step) -> None:
        """Take the blocks decide() promised and write the plan: the model gets slots and tables, never
        the block manager. Prefills first (each its chunk, after its cached prefix or earlier chunks), then
        the verifications (the newest token and its proposals), then one slot per decode; each sequence
        whose tokens are all computed after the step samples."""
        prefills = [plan_prefill(self.block_manager, s.seq_id, s.token_ids, s.num_computed, count)
                    for s, count in zip(step.prefills, step.chunks)]
        verifies = [plan_verify(self.block_manager, s.seq_id, s.last_token, p)
                    for s, p in zip(step.verifies, step.proposals)]
        decodes = plan_decode(self.block_manager, [s.seq_id for s in step.decodes],   # a token still on its way:
                              [PENDING_TOKEN if s.pending else s.last_token for s in step.decodes])  # the runner's
        for seq, count in zip(step.sequences, step.chunks + [1] * (len(step.verifies) + len(step.decodes))):
            seq.num_computed += count                  # their K/V are in the pool once the step has run (kept
                                                       # proposals count after it: Scheduler.verified)
        for seq, planned in zip(step.sequences, prefills + verifies + decodes):
            planned.sampling = seq.sampling if seq.num_computed == len(seq) + seq.pending else None   # a prompt's
            seq.pending += planned.sampling is not None                # last chunk, a decode: a token on its way
        draft_layers = getattr(self.proposer, "num_draft_layers", 0)   # early exit's placeholders; others: real tokens
        step.plan = StepPlan(prefills, verifies, decodes, draft_layers)

    def _make_room(self, seq: Sequence, blocks: int, step: Step) -> int:
        """Nothing else runs this step and the started prompt `seq` lacks `blocks` blocks: the pool is held by
        prompts part-way through their prefill (several at once, each capped at long_prefill_token_threshold).
        Preempt the youngest until it fits (perhaps seq itself); returns how many blocks came free."""
        freed = 0
        while freed < blocks and seq.status is Status.RUNNING:
            victim = choose_victim(self.running)
            freed += self._preempt(victim)
            step.preempted.append(victim)
        return freed

    def _preempt(self, seq: Sequence) -> int:
        """Preemption by recompute: free everything now, redo the prefill of all its tokens later.
        Returns how many blocks came free."""
        before = self.block_manager.num_free
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.status, seq.preemptions = Status.WAITING, seq.preemptions + 1
        self.waiting.appendleft(seq)
        return self.block_manager.num_free - before

    @property
    def cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache hits and queries, in tokens (zeros without prefix caching)."""
        return self.block_manager.stats if self.prefix_caching else PrefixCacheStats()

    def computed(self, step: Step) -> None:
        """After the model ran the step: with prefix caching, the blocks it filled become findable (a decode
        fills one only every 16th token; cache_full_blocks answers the others without building token_ids)."""
        if not self.prefix_caching:
            return
        for seq in step.prefills + step.decodes:
            self.block_manager.cache_full_blocks(seq)

    def verified(self, seq: Sequence, proposed: int, kept: int) -> None:
        """Chapter 10: after a verification, `kept` of its `proposed` tokens are the sequence's tokens now
        (appended), the rest are not: the pool holds their K/V until truncate gives back the blocks only they used.
        Then, with prefix caching, its blocks that filled with kept tokens become findable (never one with a
        rejected token: those are past the sequence's length, and a block is named only once full)."""
        self.gate.record(seq.seq_id, proposed, kept)
        seq.num_computed += kept
        self.block_manager.truncate(seq.seq_id, seq.num_computed)
        if self.prefix_caching:
            self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """A finished (or aborted) sequence gives its slot and its blocks back at once."""
        self.gate.forget(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED


# The two decisions, as module-level functions (chapter 7's exercises replace them)

def admit(scheduler: Scheduler, step: Step, free: int, budget: int) -> None:
    """Move waiting sequences to running, in arrival order, while each fits: a free slot (max_num_seqs),
    tokens left in the step's budget, and `free` blocks (those not yet promised this step). A sequence
    computes what its cached prefix does not hold, as much of it as the budget allows and at most
    scheduler.long_prefill_token_threshold tokens (a chunk; the rest follows in the next steps). Each one
    admitted goes into step.prefills, its token count into step.chunks; the first that does not fit ends
    admission (FIFO)."""
    while scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs and budget > 0:
        seq = scheduler.waiting[0]
        hit = scheduler.block_manager.lookup(seq)     # its cached prefix: costs no budget
        count = min(len(seq) - hit.tokens, budget, scheduler.long_prefill_token_threshold)
        need = scheduler.block_manager.blocks_to_admit(hit, hit.tokens + count)
        if need > free:
            break                                      # the head waits for room, nobody overtakes it
        scheduler.waiting.popleft()
        seq.status, free, budget = Status.RUNNING, free - need, budget - count
        seq.num_cached = seq.num_computed = scheduler.block_manager.admit(seq.seq_id, hit)  # at every admission
        scheduler.running.append(seq)
        step.prefills.append(seq)
        step.chunks.append(count)


def choose_victim(running: list[Sequence]) -> Sequence:
    """Which running sequence to preempt: the youngest (admitted last) — it has the least work to redo
    and the oldest keep their place, so every sequence eventually finishes."""
    return running[-1]
