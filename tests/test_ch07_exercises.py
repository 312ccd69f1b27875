"""Chapter 7 graders: the scheduler's admission under a token budget (Exercise 7.1) and its choice of whom to preempt (7.2), on the CPU.

Most graders drive the functions with a fake block manager whose state the grader sets (how many of a
prompt's tokens are cached and whether a running sequence holds them, which running sequence needs a new
block; a test checks that it answers as the engine's block managers would) and sequences without a model,
so every expected outcome is worked out by hand from the rules: FIFO, max_num_seqs, the
token budget left after the decodes (a prompt that does not fit it is split into chunks; cached tokens cost
nothing), the blocks left in the step (`free`), the youngest is the victim and goes back to the front
of the queue. The last grader plugs the implementation into the real engine on a tiny random model with a
pool small enough to force preemptions: every request's tokens must equal what it gets alone, computed
beforehand with the engine's own functions.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from tests.numeric import same
from tinyvllm.engine import scheduler as scheduler_module
from tinyvllm.engine.block_manager import BlockManager, PrefixHit, blocks_for
from tinyvllm.engine.prefix_cache import PrefixCachingBlockManager
from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.engine.scheduler import Scheduler, Step
from tinyvllm.engine.sequence import Sequence, Status
from tinyvllm.model.step_plan import BLOCK_SIZE


class FakeBlocks:
    """Stands in for the block manager: the grader sets its state, and the calls are recorded.

    A sequence's token ids all equal its id, so the fake knows whose tokens it is given. On every input the
    engine's block managers accept, it answers as they would in the state it stands for (a test below checks
    it against BlockManager and PrefixCachingBlockManager): a sequence's cached prefix is `cached[id]` tokens
    in full blocks, shared only while the tokens asked about go on past them (a full hit leaves its last
    block to compute); cached blocks nobody uses (`unused`) count as free, so sharing them takes them."""

    def __init__(self, num_free: int, cached=None, unused=(), append=None, held=None, extend=None):
        self.num_free = num_free             # what the pool reports; NOT what is left in this step
        self.cached = cached or {}           # seq id -> tokens of its prefix in the pool (a multiple of 16)
        self.unused = set(unused)            # seq ids whose cached blocks no running sequence holds
        self.extend = extend or {}           # seq id -> blocks_to_extend (default 0)
        self.append = append or {}           # seq id -> blocks_to_append (default 0)
        self.held = dict(held or {})         # seq id -> blocks it holds, given back by free()
        self.admitted, self.freed, self.lookups = [], [], []

    def lookup(self, seq: Sequence) -> PrefixHit:
        """The cached blocks a new sequence shares (fake ids: (owner, index)), as the real lookup finds them."""
        self.lookups.append(seq.seq_id)
        owner = seq.token_ids[0]
        shared = min(self.cached.get(owner, 0) // BLOCK_SIZE, (len(seq) - 1) // BLOCK_SIZE)
        return PrefixHit([(owner, i) for i in range(shared)], len(seq))

    def blocks_to_admit(self, hit: PrefixHit, num_tokens: int) -> int:
        reviving = len(hit.blocks) if hit.blocks and hit.blocks[0][0] in self.unused else 0
        return blocks_for(num_tokens) - len(hit.blocks) + reviving

    def admit(self, seq: int, hit: PrefixHit) -> int:
        self.admitted.append(seq)
        return hit.tokens

    def blocks_to_extend(self, seq: int, count: int) -> int:
        return self.extend.get(seq, 0) if count else 0

    def blocks_to_append(self, seq: int) -> int:
        return self.append.get(seq, 0)

    def free(self, seq: int) -> None:
        self.freed.append(seq)
        self.num_free += self.held.pop(seq, 0)


def make_seq(seq_id: int, prompt: int, output: int = 0) -> Sequence:
    """A sequence without a model: `prompt` prompt tokens and `output` generated ones, all equal to seq_id."""
    return Sequence(seq_id, [seq_id] * prompt, SamplingParams(temperature=0), 64, set(), decoder=None,
                    output_ids=[seq_id] * output)


def make_scheduler(blocks: FakeBlocks, max_num_seqs: int = 8, budget: int = 1000, running=(), waiting=()):
    """A Scheduler with these (seq_id, prompt length[, output length]) running (decoding: all their tokens
    but the newest in the pool) and waiting."""
    sched = Scheduler(1, max_num_seqs, budget)
    sched.block_manager = blocks             # the fake stands in for the scheduler's own block manager
    for spec in running:
        seq = make_seq(*spec)
        seq.status, seq.num_computed = Status.RUNNING, len(seq) - 1
        sched.running.append(seq)
    sched.waiting.extend(make_seq(*spec) for spec in waiting)
    return sched


def ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


# ---------- Exercise 7.1: admit ----------

@pytest.mark.ch7
def test_admit_takes_the_queue_in_order_while_everything_fits(impl):
    blocks = FakeBlocks(num_free=100)
    sched = make_scheduler(blocks, running=[(10, 20), (11, 5)],
                           waiting=[(0, 30), (1, 50), (2, 20), (3, 70), (4, 40)])
    step = Step()
    assert impl("admit")(sched, step, 100, 1000) is None, "admit returns nothing: it changes scheduler and step"
    assert ids(step.prefills) == [0, 1, 2, 3, 4], "admitted sequences go into step.prefills in arrival order"
    assert step.chunks == [30, 50, 20, 70, 40], "step.chunks[i]: the tokens step.prefills[i] computes (all of them)"
    assert ids(sched.running) == [10, 11, 0, 1, 2, 3, 4], "admitted sequences go to the END of running"
    assert not sched.waiting, f"everyone fits: nobody should be left waiting, got {ids(sched.waiting)}"
    same([s.status for s in sched.running], [Status.RUNNING] * 7, "the status of every running sequence")
    assert blocks.admitted == [0, 1, 2, 3, 4], "block_manager.admit(seq_id, hit) once per admitted sequence"
    same([(s.num_cached, s.num_computed) for s in step.prefills], [(0, 0)] * 5,
         "(num_cached, num_computed) of each admitted sequence (nothing is cached: block_manager.admit returned 0)")
    assert step.decodes == [] and step.preempted == [], "admit only fills step.prefills and step.chunks"


@pytest.mark.ch7
def test_admit_stops_at_the_first_that_does_not_fit_nobody_overtakes(impl):
    """Hand-derived: 4 blocks free; seq 0 takes 2, seq 1 needs 5 > 2: it stops admission, and seq 2
    (1 block, it would fit) must not overtake it."""
    blocks = FakeBlocks(num_free=4)
    sched = make_scheduler(blocks, waiting=[(0, 30), (1, 70), (2, 10)])
    step = Step()
    impl("admit")(sched, step, 4, 1000)
    assert ids(step.prefills) == [0], "FIFO: the first that does not fit ends admission"
    assert ids(sched.waiting) == [1, 2], "a refused sequence stays at the head of the queue"
    assert isinstance(sched.waiting, deque), f"scheduler.waiting must stay a deque, got {type(sched.waiting).__name__}"
    same([s.status for s in sched.waiting], [Status.WAITING] * 2, "the status of the sequences still waiting")
    assert blocks.admitted == [0], "block_manager.admit must not be called for a refused sequence"
    assert blocks.freed == [], "nothing is freed by admission"


@pytest.mark.ch7
def test_admit_uses_the_blocks_left_in_this_step_not_the_pool(impl):
    """`free` is what is left after this step's decodes claimed theirs; the pool still reports 50."""
    blocks = FakeBlocks(num_free=50)
    sched = make_scheduler(blocks, waiting=[(0, 20), (1, 20), (2, 20)])   # 2 blocks each
    step = Step()
    impl("admit")(sched, step, 3, 1000)
    assert ids(step.prefills) == [0], "2 + 2 blocks do not fit in the 3 left this step (use `free`, not num_free)"
    blocks, step = FakeBlocks(num_free=50), Step()
    sched = make_scheduler(blocks, waiting=[(0, 20), (1, 20), (2, 20)])
    impl("admit")(sched, step, 4, 1000)
    assert ids(step.prefills) == [0, 1], "exactly enough blocks: it fits"


@pytest.mark.ch7
def test_admit_asks_the_block_manager_how_many_blocks_a_prompt_takes(impl):
    """A 60-token prompt whose first 3 blocks are cached (and held by a running sequence) takes 1 new block,
    not ceil(60 / 16) = 4. When nobody holds those cached blocks, they count as free, and sharing them
    takes them: 4 again. Only blocks_to_admit knows."""
    blocks = FakeBlocks(num_free=3, cached={0: 48})
    sched = make_scheduler(blocks, waiting=[(0, 60), (1, 30), (2, 1)])
    step = Step()
    impl("admit")(sched, step, 3, 1000)
    assert ids(step.prefills) == [0, 1], "seq 0 takes 1 block (blocks_to_admit), seq 1 the other 2"
    same(ids(sched.waiting), [2], "who is still waiting")
    blocks = FakeBlocks(num_free=3, cached={0: 48}, unused={0})
    sched = make_scheduler(blocks, waiting=[(0, 60)])
    step = Step()
    impl("admit")(sched, step, 3, 1000)
    same(ids(step.prefills), [], "step.prefills when the prompt's 3 cached blocks are unused: sharing them takes "
         "them, so it needs 4 blocks (blocks_to_admit says so), and 3 are free")


@pytest.mark.ch7
def test_admit_respects_max_num_seqs(impl):
    blocks = FakeBlocks(num_free=100)
    sched = make_scheduler(blocks, max_num_seqs=4, running=[(10, 5), (11, 5)],
                           waiting=[(0, 5), (1, 5), (2, 5), (3, 5)])
    step = Step()
    impl("admit")(sched, step, 100, 1000)
    assert ids(step.prefills) == [0, 1], "4 slots, 2 taken: two more"
    same(ids(sched.waiting), [2, 3], "who is still waiting")
    same(len(sched.running), 4, "len(scheduler.running)")
    blocks = FakeBlocks(num_free=100)
    sched = make_scheduler(blocks, max_num_seqs=2, running=[(10, 5), (11, 5)], waiting=[(0, 5)])
    step = Step()
    impl("admit")(sched, step, 100, 1000)
    assert step.prefills == [] and blocks.admitted == [] and ids(sched.waiting) == [0], "no free slot: nobody"


@pytest.mark.ch7
def test_admit_splits_the_prompt_the_budget_cannot_hold(impl):
    """Hand-derived: budget 100 (what the decodes left). 40 + 50 tokens leave 10: the 20-token prompt
    starts with a chunk of 10, and the budget is spent: the 5-token one waits."""
    blocks = FakeBlocks(num_free=100)
    sched = make_scheduler(blocks, budget=1000, waiting=[(0, 40), (1, 50), (2, 20), (3, 5)])
    step = Step()
    impl("admit")(sched, step, 100, 100)
    assert ids(step.prefills) == [0, 1, 2] and step.chunks == [40, 50, 10], \
        "each computes min(its uncached tokens, the budget left): the third gets a chunk of 10"
    assert sum(step.chunks) <= 100, "the step's budget is `budget`, not max_num_batched_tokens"
    same(ids(sched.waiting), [3], "who is still waiting")
    same(blocks.admitted, [0, 1, 2], "the sequences block_manager.admit was called for")
    blocks = FakeBlocks(num_free=100)
    sched = make_scheduler(blocks, budget=1000, waiting=[(0, 60), (1, 40), (2, 1)])
    step = Step()
    impl("admit")(sched, step, 100, 100)
    assert step.chunks == [60, 40] and ids(sched.waiting) == [2], "60 + 40 = 100: nothing left for a third"


@pytest.mark.ch7
def test_admit_takes_at_most_the_long_prefill_threshold_of_one_prompt(impl):
    """Hand-derived: budget 100, at most 30 tokens of one prompt per step. The 70-token prompt starts with
    30, the 20-token one whole (20 <= 30), the 50-token one with 30; 20 of the budget is left for the
    4-token one."""
    blocks = FakeBlocks(num_free=100)
    sched = make_scheduler(blocks, budget=1000, waiting=[(0, 70), (1, 20), (2, 50), (3, 4)])
    sched.long_prefill_token_threshold = 30
    step = Step()
    impl("admit")(sched, step, 100, 100)
    same((ids(step.prefills), step.chunks), ([0, 1, 2, 3], [30, 20, 30, 4]),
         "(step.prefills ids, step.chunks) with scheduler.long_prefill_token_threshold = 30")


@pytest.mark.ch7
def test_admit_with_no_budget_left_admits_nobody(impl):
    """The decodes took the whole budget: nobody starts, and block_manager.admit is not called."""
    blocks = FakeBlocks(num_free=100)
    sched = make_scheduler(blocks, waiting=[(0, 5)])
    step = Step()
    impl("admit")(sched, step, 100, 0)
    same(ids(step.prefills), [], "step.prefills with no budget left")
    same(blocks.admitted, [], "the sequences block_manager.admit was called for")
    same(ids(sched.waiting), [0], "who is still waiting")


@pytest.mark.ch7
def test_admit_a_chunk_takes_the_blocks_of_the_chunk(impl):
    """A 200-token prompt with a budget of 40 computes 40 tokens now: it needs the 3 blocks of its
    first 40 tokens (blocks_to_admit(hit, 40)), not the 13 of the whole prompt."""
    blocks = FakeBlocks(num_free=3)
    sched = make_scheduler(blocks, waiting=[(0, 200)])
    step = Step()
    impl("admit")(sched, step, 3, 40)
    same((ids(step.prefills), step.chunks), ([0], [40]), "(step.prefills ids, step.chunks): a chunk of 40 in 3 blocks")


@pytest.mark.ch7
def test_admit_cached_tokens_do_not_use_the_budget(impl):
    """Hand-derived: budget 100. Seq 0 (60 tokens, 48 cached) costs 12, leaving 88; seq 1 (80 tokens,
    none cached) takes 80, leaving 8; seq 2 (10 tokens) starts with a chunk of 8."""
    blocks = FakeBlocks(num_free=100, cached={0: 48})
    sched = make_scheduler(blocks, waiting=[(0, 60), (1, 80), (2, 10)])
    step = Step()
    impl("admit")(sched, step, 100, 100)
    assert ids(step.prefills) == [0, 1, 2] and step.chunks == [12, 80, 8], \
        "only the tokens prefill computes (len - cached) use the budget"
    assert [s.num_cached for s in step.prefills] == [48, 0, 0], "seq.num_cached = what block_manager.admit returned"
    assert [s.num_computed for s in step.prefills] == [48, 0, 0], "seq.num_computed starts at num_cached"


@pytest.mark.ch7
def test_admit_a_preempted_sequence_recomputes_all_its_tokens(impl):
    """A preempted sequence (30 prompt + 40 output tokens, stale counts from its first run) is admitted
    on all 70 of its tokens: with a budget of 64 a chunk of 64, which takes 4 blocks."""
    admit = impl("admit")
    for free, admitted in ((3, []), (4, [0])):
        blocks = FakeBlocks(num_free=100)
        sched = make_scheduler(blocks, waiting=[(0, 30, 40), (1, 5)])
        sched.waiting[0].num_cached = sched.waiting[0].num_computed = 64   # from before the preemption
        step = Step()
        admit(sched, step, free, 64)
        assert ids(step.prefills) == admitted, f"64 of its 70 tokens need 4 blocks; {free} are left"
    assert step.chunks == [64], "prompt AND output are recomputed: 70 tokens, 64 of them this step"
    assert step.prefills[0].num_computed == 0 and step.prefills[0].num_cached == 0, \
        "a readmitted sequence starts over: num_cached and num_computed from block_manager.admit, not from before"


@pytest.mark.ch7
def test_admit_a_preempted_sequence_finds_its_output_in_the_cache(impl):
    """Hand-derived: a preempted sequence of 20 prompt + 30 output tokens whose first 3 blocks (48 tokens,
    output included) are still cached: it computes the 2 tokens after them, not the 34 after the 16 cached
    tokens of its prompt alone. Its cached blocks are unused, so it takes all 4 of its blocks."""
    blocks = FakeBlocks(num_free=100, cached={0: 48}, unused={0})
    sched = make_scheduler(blocks, waiting=[(0, 20, 30)])
    step = Step()
    impl("admit")(sched, step, 4, 100)
    same((ids(step.prefills), step.chunks), ([0], [2]), "(step.prefills ids, step.chunks): look up the cached "
         "prefix of all its tokens (seq.token_ids), prompt and output")
    same((step.prefills[0].num_cached, step.prefills[0].num_computed), (48, 48), "(num_cached, num_computed)")


@pytest.mark.ch7
def test_admit_with_nobody_waiting_does_nothing(impl):
    blocks = FakeBlocks(num_free=10)
    sched = make_scheduler(blocks, running=[(3, 10)])
    step = Step()
    impl("admit")(sched, step, 10, 100)
    same((ids(step.prefills), ids(sched.running), blocks.admitted), ([], [3], []),
         "(step.prefills, scheduler.running, block_manager.admit calls) with nobody waiting")


@pytest.mark.ch7
def test_admit_inside_decide_gets_what_the_decodes_and_a_started_prompt_left(impl, monkeypatch):
    """Through Scheduler.decide, budget 64: two decoding sequences each open a block (5 free -> 3 left)
    and take 1 token each; seq 2, a prompt started earlier (60 tokens, 40 computed), continues with its
    last 20 tokens from token 40, taking 1 block; of the 42 tokens left, seq 5 (30 tokens, 2 blocks)
    starts whole, and seq 6 gets no block."""
    monkeypatch.setattr(scheduler_module, "admit", impl("admit"))
    blocks = FakeBlocks(num_free=5, append={0: 1, 1: 1}, extend={2: 1})
    sched = make_scheduler(blocks, budget=64, running=[(0, 16, 1), (1, 32, 1), (2, 60)],
                           waiting=[(5, 30), (6, 10)])
    sched.running[2].num_computed = 40                    # a prompt halfway through (the others decode)
    step = sched.decide()
    same((ids(step.decodes), ids(step.preempted)), ([0, 1], []), "(decodes, preempted) of the step")
    assert ids(step.prefills) == [2, 5] and step.chunks == [20, 30], \
        f"the started prompt goes on from token 40: expected prefills [2, 5] with chunks [20, 30], got " \
        f"{ids(step.prefills)} with {step.chunks}"
    assert len(step.decodes) + sum(step.chunks) <= 64, "the step computes more tokens than its budget of 64"
    same(ids(sched.waiting), [6], "who is still waiting (seq 6 gets no block)")


# ---------- Exercise 7.2: choose_victim ----------

@pytest.mark.ch7
def test_choose_victim_is_the_youngest(impl, rng):
    """The last admitted, whatever the ids or lengths (a sequence admitted again after a preemption is young)."""
    choose = impl("choose_victim")
    for n in (1, 2, 5, 17):
        running = [make_seq(int(i), int(rng.integers(1, 200)), int(rng.integers(0, 50)))
                   for i in rng.permutation(100)[:n]]
        before = list(running)
        victim = choose(running)
        assert victim is before[-1], f"running ids {ids(before)}: the youngest is the last one, {before[-1].seq_id}"
        assert running == before and all(a is b for a, b in zip(running, before)), "the list must not change"


@pytest.mark.ch7
def test_choose_victim_goes_by_admission_not_arrival(impl):
    """Hand-derived: sequences 0..3 arrived in that order; seq 0 was preempted and admitted again, so
    running reads 1, 2, 3, 0 and the youngest is seq 0, the first to have arrived."""
    arrived = [make_seq(i, 20, 5) for i in range(4)]
    for i, seq in enumerate(arrived):
        seq.arrival_time = float(i)
    running = arrived[1:] + arrived[:1]
    running[-1].preemptions = 1
    victim = impl("choose_victim")(running)
    same(victim.seq_id, 0, "the victim's id, running ids [1, 2, 3, 0] (seq 0 arrived first but was admitted "
         "last, after its preemption)")


@pytest.mark.ch7
def test_choose_victim_is_the_youngest_whether_it_decodes_or_not(impl):
    """Hand-derived: running reads 0 (decoding), 1 (halfway through its prompt), 2 (decoding): the youngest
    is seq 2, although seq 1 has computed less."""
    running = [make_seq(0, 40, 3), make_seq(1, 40), make_seq(2, 40, 3)]
    running[0].num_computed = running[2].num_computed = 42   # decoding: all but the newest token in the pool
    running[1].num_computed = 16                             # 16 of its 40 prompt tokens so far
    victim = impl("choose_victim")(running)
    same(victim.seq_id, 2, "the victim's id, running ids [0, 1, 2] with seq 1 in the middle of its prompt")


@pytest.mark.ch7
def test_choose_victim_in_schedule_preempts_the_youngest_and_requeues_it_first(impl, monkeypatch):
    """Hand-derived: 1 free block, three running sequences each opening a block. Seq 0 takes it; seq 1
    finds none, so the youngest (seq 2, holding 2 blocks) is preempted; seq 1 then decodes. Seq 2 goes
    to the FRONT of the queue, ahead of seq 7, and nobody is admitted in a step that preempted."""
    monkeypatch.setattr(scheduler_module, "choose_victim", impl("choose_victim"))
    blocks = FakeBlocks(num_free=1, append={0: 1, 1: 1, 2: 1}, held={0: 3, 1: 3, 2: 2})
    sched = make_scheduler(blocks, running=[(0, 48), (1, 32), (2, 16)], waiting=[(7, 5)])
    step = sched.decide()
    same((ids(step.decodes), ids(step.preempted), ids(step.prefills)), ([0, 1], [2], []),
         "(decodes, preempted, prefills) of the step")
    same((ids(sched.running), ids(sched.waiting), blocks.freed), ([0, 1], [2, 7], [2]),
         "(running, waiting, blocks freed) after the step: the victim goes to the FRONT of the queue")
    victim = step.preempted[0]
    same((victim.status, victim.preemptions), (Status.WAITING, 1), "the victim's (status, preemptions)")


@pytest.mark.ch7
def test_choose_victim_in_schedule_may_preempt_the_asker(impl, monkeypatch):
    """The youngest needs a block and none is free: it is its own victim; the older one decodes."""
    monkeypatch.setattr(scheduler_module, "choose_victim", impl("choose_victim"))
    blocks = FakeBlocks(num_free=0, append={1: 1}, held={0: 2, 1: 2})
    sched = make_scheduler(blocks, running=[(0, 20), (1, 32)])
    step = sched.decide()
    same((ids(step.decodes), ids(step.preempted), ids(sched.waiting)), ([0], [1], [1]),
         "(decodes, preempted, waiting): the youngest, seq 1, steps aside for the older seq 0")


@pytest.mark.ch7
def test_choose_victim_in_schedule_preempts_youngest_first_until_it_fits(impl, monkeypatch):
    """Four running, all opening a block, none free, one block each: seq 0 preempts 3, seq 1 preempts 2.
    Each victim goes to the front, so the queue reads 2, 3, 9: the older of the two first."""
    monkeypatch.setattr(scheduler_module, "choose_victim", impl("choose_victim"))
    blocks = FakeBlocks(num_free=0, append={0: 1, 1: 1, 2: 1, 3: 1}, held={0: 1, 1: 1, 2: 1, 3: 1})
    sched = make_scheduler(blocks, running=[(0, 16), (1, 16), (2, 16), (3, 16)], waiting=[(9, 4)])
    step = sched.decide()
    same((ids(step.decodes), ids(step.preempted)), ([0, 1], [3, 2]), "(decodes, preempted) of the step")
    same((ids(sched.waiting), blocks.freed), ([2, 3, 9], [3, 2]), "(waiting, blocks freed) after the step")


# ---------- the fake block manager answers as the real ones ----------

def real_manager(prefix_caching: bool, owner: int, cached: int, in_use: bool) -> BlockManager:
    """A real block manager holding, when prefix caching, a cached prefix of `cached` tokens all equal to
    `owner` (as FakeBlocks' sequence `owner` has it), held by a running sequence or left unused."""
    if not prefix_caching:
        return BlockManager(32)
    real, holder = PrefixCachingBlockManager(32), Sequence(999, [owner] * cached, SamplingParams(), 64, set(), None)
    if cached:
        real.admit(999, real.lookup(holder))
        real.extend(999, cached)
        real.cache_full_blocks(holder)
        if not in_use:
            real.free(999)
    return real


@pytest.mark.parametrize("prefix_caching, cached, in_use", [(False, 0, False), (True, 0, False), (True, 48, True),
                                                             (True, 48, False), (True, 16, False)])
def test_fake_blocks_answers_as_the_real_block_managers(prefix_caching, cached, in_use):
    """lookup of a sequence of every length, blocks_to_admit of its hit for every number of tokens from none
    to all of them (an admit that asks before checking the budget may ask about its cached tokens alone),
    and admit: for the owner of the cached prefix and for another sequence."""
    owner = 5
    for seq_id, length in [(s, n) for s in (owner, 6) for n in range(1, cached + 40)]:
        real = real_manager(prefix_caching, owner, cached, in_use)
        fake = FakeBlocks(real.num_free, cached={owner: cached} if prefix_caching else {},
                          unused=() if in_use else {owner})
        seq = make_seq(seq_id, length)
        what = f"{length} tokens of sequence {seq_id}, {cached} of sequence {owner}'s cached (in use: {in_use})"
        same(fake.num_free, real.num_free, f"num_free, {what}")
        fake_hit, real_hit = fake.lookup(seq), real.lookup(seq)
        same(fake_hit.tokens, real_hit.tokens, f"lookup's tokens, {what}")
        for n in range(fake_hit.tokens, length + 1):
            same(fake.blocks_to_admit(fake_hit, n), real.blocks_to_admit(real_hit, n), f"blocks_to_admit(hit, {n}), {what}")
        same(fake.admit(seq_id, fake_hit), real.admit(seq_id, real_hit), f"admit, {what}")


# ---------- both, inside the engine ----------

@pytest.fixture(scope="module")
def workload(tiny_model_dir):
    """Random requests (half greedy, half sampled with a seed) and each one's tokens alone, generated
    with the engine's own admit and choose_victim (not the code under test). The workload is seeded: with
    fresh draws one CI run saw a request differ from its run alone (not reproduced in 40 seeded reruns;
    a float32 rounding difference between a batch, or a recomputed prefix, and a single run can tip a
    draw). What this grader varies is the scheduling, which the functions under test decide."""
    from tinyvllm import LLM
    alone, rng = LLM(str(tiny_model_dir), device="cpu", num_blocks=64), np.random.default_rng(0)
    prompts = [rng.integers(0, alone.model_config.vocab_size, int(rng.integers(17, 60))).tolist() for _ in range(16)]
    # sampled rows keep their 5 likeliest tokens: over a random model's flat distribution, a float32
    # rounding difference between a batch of 6 and a batch of 1 could otherwise tip a draw to a neighbour
    params = [SamplingParams(temperature=0.8 * (i % 2), top_k=5, seed=int(rng.integers(1 << 30)), ignore_eos=True,
                             max_tokens=int(rng.integers(20, 41))) for i in range(16)]
    return prompts, params, [alone.generate([p], s)[0].token_ids for p, s in zip(prompts, params)]


MAX_STEPS = 2000  # 16 requests of at most 40 tokens finish in a few hundred steps, preemptions included


@pytest.mark.ch7
def test_admit_and_choose_victim_in_the_engine_change_no_answer(impl, monkeypatch, tiny_model_dir, workload):
    """16 requests, 6 slots, a pool of 12 blocks (each request alone needs up to 7): the pool runs dry and
    sequences are preempted and recomputed. Every request's tokens must equal what it got alone."""
    from tinyvllm import LLM
    prompts, params, alone = workload
    monkeypatch.setattr(scheduler_module, "admit", impl("admit"))
    monkeypatch.setattr(scheduler_module, "choose_victim", impl("choose_victim"))
    llm = LLM(str(tiny_model_dir), device="cpu", num_blocks=12, max_num_seqs=6, max_num_batched_tokens=128)
    engine = llm.engine
    seqs = [llm.add_request(p, s) for p, s in zip(prompts, params)]
    for _ in range(MAX_STEPS):  # what LLM.generate does, with a limit: a wrong admit can stall the loop
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work(), f"not finished after {MAX_STEPS} steps: does admit set seq.status to RUNNING?"
    assert sum(s.preemptions for s in seqs) > 0, "the pool was meant to run out"
    for i, (seq, expected) in enumerate(zip(seqs, alone)):
        assert seq.output_ids == expected, f"request {i} ({len(prompts[i])} prompt tokens) differs from its run alone"
    trace = engine.trace_since(0)  # every step of this run (an error if the ring forgot some)
    first = [s for t in trace for s in t.prefill]
    first = [s for i, s in enumerate(first) if s not in first[:i]]
    assert first == sorted(first), "a request started before one that arrived earlier"
    assert max(len(t.prefill) + len(t.decode) for t in trace) <= 6, "more than max_num_seqs ran in a step"
    assert llm.engine.scheduler.block_manager.num_free == 12 and not llm.engine.scheduler.block_manager.tables, "blocks were not all given back"
