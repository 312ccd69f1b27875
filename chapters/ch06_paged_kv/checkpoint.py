"""`make chapter-6`: five prompts of different lengths answered together from ONE small pool of 16-token blocks.

    make chapter-6                  # python -m chapters 6: on the GPU if CuPy sees one, else on the CPU
    make chapter-6 IMPL=student     # the same, with your BlockManager (6.1) and slot_mapping (6.2) in the engine

The prompts are prefilled one after another into a PagedKVPool of NUM_BLOCKS blocks, then decoded
together, one decode step for all of them per token. The block manager keeps the books: for every step it
takes the blocks and hands the model a plan (the slots to write, the block tables to read); the model
never calls it. As answers grow, their new blocks interleave in the
pool; one request is cancelled early (its blocks become holes) and a finished answer frees its blocks too;
the pool is small enough that later blocks must reuse those holes. The block tables and the pool's
occupancy are printed along the way. Then three checks:
  (a) each answer's greedy tokens equal what its prompt gives alone through chapter 5's ContiguousKVCache
      (on a GPU, 90% of the tokens: bf16 sums in another order may flip a near tie);
  (b) the block manager stayed consistent after every step (no block twice, none lost, ref counts right,
      ceil(L / 16) blocks for L tokens) and all blocks are free at the end;
  (c) the block manager and slot_mapping in tinyvllm.engine.block_manager (yours, with --impl student) replay the
      run's calls exactly like a fresh copy of the engine's block_manager.py.
Engine code is reached through its modules (this program builds `block_manager.BlockManager`, which calls
`block_manager.slot_mapping`), so the student's code, plugged in by --impl student, is what runs.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

from chapters.ch01_map.checkpoint import Stage
from chapters.ch03_prefill.checkpoint import print_table
from chapters.ch05_decode import checkpoint as ch05
from tinyvllm.engine import block_manager
from tinyvllm.engine.block_manager import BLOCK_SIZE, OutOfBlocks, blocks_for
from tinyvllm.model.sampler import sample
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.checkpoints import resolve_model
from tinyvllm.formats.tokenizer import IncrementalDecoder, Tokenizer, load_tokenizer
from tinyvllm.model.backend import cuda_available
from tinyvllm.model.decode import decode_batch
from tinyvllm.model.kv_pool import ContiguousKVCache, PagedKVPool, bytes_per_block
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill_batch

LONG_PROMPT = (
    "Here are my notes from one week of looking after a small vegetable garden. Monday: the tomatoes "
    "needed water twice because the afternoon was hot and dry, and two of the plants had yellow leaves "
    "near the soil. Tuesday: I tied the beans to new stakes after the wind bent them, and picked the first "
    "handful of radishes. Wednesday: it rained all day, so I stayed inside and planned where the garlic "
    "will go in autumn. Thursday: slugs had eaten half of the lettuce; I put down a ring of crushed eggshells "
    "around each plant. Friday: the cucumbers started to flower, and I counted eleven small courgettes. "
    "Saturday: I weeded the carrot bed and gave everything a deep watering in the evening. Sunday: I rested. "
    "What should I do differently next week?")
PROMPTS = ch05.PROMPTS + [LONG_PROMPT]   # 37, 34, 33, 34 and 189 tokens with the chat template
MAX_NEW_TOKENS = 24
NUM_BLOCKS = 26      # what the five need at their largest (the long one alone takes 14): nothing to spare
CANCEL = (1, 8)      # sequence 1's request is cancelled after decode step 8: its blocks become holes
MAX_TOKENS = 256     # the engine's buffers: the longest prompt, in one prefill


def cached_tokens(bm) -> int:
    return sum(bm.lengths.values())


def pool_map(bm, num_blocks: int) -> str:
    """One character per physical block: the sequence that owns it, '.' if free."""
    owner = ["."] * num_blocks
    for seq, table in bm.tables.items():
        for block in table:
            owner[block] = str(seq)
    return "".join(owner)


def occupancy(bm, num_blocks: int) -> str:
    used = num_blocks - bm.num_free
    tokens = cached_tokens(bm)
    return (f"{used} of {num_blocks} blocks used, {bm.num_free} free; {tokens} tokens in {used * BLOCK_SIZE} slots: "
            f"{used * BLOCK_SIZE - tokens} empty slots in last blocks")


def consistency_problems(bm, num_blocks: int) -> list[str]:
    """What is wrong with the block manager's state, checked from its fields: [] if nothing."""
    used = [b for table in bm.tables.values() for b in table]
    free = list(bm.free_blocks)
    problems = []
    if len(set(used)) != len(used):
        problems.append("a block is in two tables")
    if len(set(free)) != len(free) or set(used) & set(free):
        problems.append("a block is free twice, or free and used")
    if set(used) | set(free) != set(range(num_blocks)):
        problems.append("a block was lost")
    if any(bm.ref_counts[b] != used.count(b) for b in range(num_blocks)):
        problems.append("a ref count is not the number of tables holding the block")
    if any(len(bm.tables[s]) != blocks_for(n) for s, n in bm.lengths.items()):
        problems.append("a sequence does not hold ceil(length / 16) blocks")
    return problems


# ---- the run: prefill each prompt into the pool, then decode all of them together ----

@dataclass
class Snapshot:
    """The block manager after one moment of the run."""
    step: int                        # 0: after the prefills; n: after decode step n
    tables: dict[int, list[int]]     # sequence -> its physical blocks, logical block 0 first
    lengths: dict[int, int]          # sequence -> tokens cached
    event: str = ""                  # what happened at this step (a sequence finished, was cancelled)


@dataclass
class Run:
    prompts: list[list[int]]
    num_blocks: int
    tokens: dict[int, list[int]] = field(default_factory=dict)   # each answer, its stop token included
    ended: dict[int, str] = field(default_factory=dict)           # "stop", "length" or "cancelled"
    snapshots: list[Snapshot] = field(default_factory=list)
    calls: list[tuple] = field(default_factory=list)              # the block manager calls, in order:
    # ("allocate", seq, tokens) for a prefill, ("append_slot", seq) per decode step, ("free", seq)
    problems: list[str] = field(default_factory=list)             # consistency problems seen, with the step
    seconds: float = 0.0


def snapshot(run: Run, bm, step: int, event: str) -> None:
    run.snapshots.append(Snapshot(step, {s: list(t) for s, t in bm.tables.items()}, dict(bm.lengths), event))
    run.problems += [f"step {step}: {p}" for p in consistency_problems(bm, run.num_blocks)]


def run_together(model: Model, tok: Tokenizer, prompts: list[list[int]], num_blocks: int = NUM_BLOCKS,
                 cancel: tuple[int, int] | None = CANCEL, on_snapshot=None) -> Run:
    """Prefill every prompt into one PagedKVPool, then decode them all together (greedy) until each stops,
    reaches MAX_NEW_TOKENS or is cancelled; its blocks are freed at once. on_snapshot(run, blocks) is
    called after the prefills and after every decode step."""
    pool, stops = PagedKVPool(model.cfg, model.ops, num_blocks), ch05.stop_ids(tok, model.cfg)
    blocks = block_manager.BlockManager(num_blocks)   # through the module: Exercise 6.1 plugs in here
    run, start = Run(prompts, num_blocks), time.perf_counter()
    rng = np.random.default_rng(0)  # greedy never draws from it

    def finish(seq: int, why: str) -> None:
        blocks.free(seq)
        run.calls.append(("free", seq))
        run.ended[seq] = why

    for seq, ids in enumerate(prompts):
        plan = block_manager.plan_prefill(blocks, seq, ids)   # blocks.allocate: its slots and its table
        run.calls.append(("allocate", seq, len(ids)))
        run.tokens[seq] = [sample(prefill_batch(model, pool, [plan])[0], ch05.GREEDY, rng)]
    running, step, events = list(range(len(prompts))), 0, []
    while True:
        for seq in list(running):  # an answer ends at a stop token or at MAX_NEW_TOKENS: its blocks go back
            if run.tokens[seq][-1] in stops or len(run.tokens[seq]) == MAX_NEW_TOKENS:
                finish(seq, "stop" if run.tokens[seq][-1] in stops else "length")
                running.remove(seq)
                events.append(f"sequence {seq} finished")
        snapshot(run, blocks, step, ", ".join(events))
        if on_snapshot:
            on_snapshot(run, blocks)
        if not running:
            break
        step += 1
        plan = block_manager.plan_decode(blocks, running, [run.tokens[s][-1] for s in running])  # append_slot each
        run.calls += [("append_slot", s) for s in running]
        logits = decode_batch(model, pool, plan)
        for row, seq in enumerate(running):
            run.tokens[seq].append(sample(logits[row], ch05.GREEDY, rng))
        events = []
        if cancel and cancel[1] == step and cancel[0] in running:  # the client went away
            finish(cancel[0], "cancelled")
            running.remove(cancel[0])
            events.append(f"sequence {cancel[0]} cancelled")
    run.seconds = time.perf_counter() - start
    if blocks.num_free != num_blocks or blocks.tables:
        run.problems.append(f"the end: {blocks.num_free} of {num_blocks} blocks free, {len(blocks.tables)} tables left")
    return run


# ---- printing ----

def holders(snapshots: list[Snapshot]) -> dict[int, set[int]]:
    """Physical block -> every sequence that held it in these snapshots."""
    held: dict[int, set[int]] = {}
    for snap in snapshots:
        for seq, table in snap.tables.items():
            for block in table:
                held.setdefault(block, set()).add(seq)
    return held


def print_tables(bm, run: Run, title: str) -> None:
    """Occupancy, the pool map and every block table; a block marked * was another sequence's before."""
    held = holders(run.snapshots)
    print(f"[{title}] {occupancy(bm, run.num_blocks)}")
    print(f"  pool   {pool_map(bm, run.num_blocks)}")
    for seq, table in sorted(bm.tables.items()):
        print(f"  seq {seq}  {bm.lengths[seq]:3d} tokens  logical -> physical  "
              + "  ".join(f"{i}->{b}{'*' if held[b] - {seq} else ''}" for i, b in enumerate(table)))
    print(f"  free list, next first: {list(bm.free_blocks)}\n")


def printer(points: set[int]):
    """An on_snapshot callback that prints the block tables at the given steps and wherever something happened."""
    def on_snapshot(run: Run, blocks) -> None:
        snap = run.snapshots[-1]
        if snap.step in points or snap.event:
            title = f"step {snap.step}" + (f": {snap.event}" if snap.event else "")
            print_tables(blocks, run, "after the prefills" if snap.step == 0 else title)
    return on_snapshot


def answer_text(tok: Tokenizer, tokens: list[int], stops: set[int]) -> str:
    decoder = IncrementalDecoder(tok)
    text = "".join(decoder.feed(t) for t in tokens if t not in stops) + decoder.flush()
    return text.replace("\n", " ")


# ---- the checks ----

GPU_AGREEMENT = 0.9  # on a GPU the paged kernel may split a context between blocks (chapter 7): its fp32 sums
                     # run in another order than the contiguous kernel's and can flip a near tie (random weights have many)


def token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[list[int], float]:
    """Which answers differ from their reference, and the fraction of tokens that agree position by position."""
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    pairs = [(a, b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    return differ, sum(a == b for a, b in pairs) / max(len(pairs), 1)


def check_alone(model: Model, tok: Tokenizer, run: Run) -> Stage:
    """(a) every answer against its prompt decoded alone through chapter 5's contiguous cache: identical on
    the CPU, >= GPU_AGREEMENT of the tokens on a GPU."""
    start, expected = time.perf_counter(), []
    for seq, ids in enumerate(run.prompts):
        cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=len(ids) + MAX_NEW_TOKENS)
        alone = ch05.generate(model, tok, ids, cache, 0, max_new_tokens=MAX_NEW_TOKENS).tokens
        cancelled = run.ended[seq] == "cancelled"
        expected.append(alone[:len(run.tokens[seq])] if cancelled else alone)  # a cancelled answer: a prefix
    differ, agree = token_agreement([run.tokens[seq] for seq in range(len(run.prompts))], expected)
    ok = not differ if model.ops.xp.__name__ == "numpy" else agree >= GPU_AGREEMENT
    n = sum(len(t) for t in run.tokens.values())
    return Stage("(a) greedy tokens vs each prompt alone", f"{len(run.prompts)} answers, {n} tokens",
                 time.perf_counter() - start, "ContiguousKVCache, one sequence: " +
                 ("identical" if not differ else f"sequences {differ} differ ({agree:.1%} of tokens agree)"), ok)


def check_consistency(run: Run) -> Stage:
    """(b) the block manager's state after the prefills, after every decode step, and at the end."""
    first = run.problems[0] if run.problems else "none lost, none twice, all free at the end"
    return Stage("(b) block manager consistency", f"{len(run.snapshots)} snapshots", 0.0,
                 first + (f" (+{len(run.problems) - 1} more)" if len(run.problems) > 1 else ""), not run.problems)


def engine_block_manager() -> ModuleType:
    """A fresh copy of tinyvllm/engine/block_manager.py: the engine's own code, even after --impl student has
    replaced BlockManager and slot_mapping in the imported module."""
    spec = importlib.util.find_spec("tinyvllm.engine.block_manager")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay(module, calls: list[tuple], num_blocks: int) -> list:
    """The run's block manager calls on a fresh module.BlockManager, then two that must be refused: a
    prompt too big for the pool, and a sequence outgrowing it. Every result and every state after a call,
    as plain values."""
    bm, seen, too_big = module.BlockManager(num_blocks), [], num_blocks * BLOCK_SIZE
    refused = [("allocate", -1, too_big + 1), ("allocate", -1, 1), ("extend", -1, too_big), ("free", -1)]
    for call in calls + refused:
        try:
            if call[0] == "allocate":
                result = bm.allocate(call[1], call[2]).tolist()
            elif call[0] == "extend":
                result = bm.extend(call[1], call[2]).tolist()
            elif call[0] == "append_slot":
                result = int(bm.append_slot(call[1]))
            else:
                result = bm.free(call[1])
        except TinyVLLMError as e:  # OutOfBlocks of either copy: compared by name
            result = type(e).__name__
        seen.append((call, result, list(bm.free_blocks), list(bm.ref_counts),
                     {s: list(t) for s, t in bm.tables.items()}, dict(bm.lengths)))
    return seen


def check_exercises(run: Run) -> Stage:
    """(c) tinyvllm.engine.block_manager's BlockManager and slot_mapping (the student's, once plugged in) against
    the engine's: the run's calls replayed on both, and every block table of the run mapped by both."""
    start, engine = time.perf_counter(), engine_block_manager()
    ours, theirs = replay(block_manager, run.calls, run.num_blocks), replay(engine, run.calls, run.num_blocks)
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    windows = [(table, start_, count) for snap in run.snapshots for seq, table in snap.tables.items()
               for start_, count in [(0, snap.lengths[seq]), (snap.lengths[seq] - 1, 1), (7, snap.lengths[seq] - 7)]
               if count >= 0]
    slots_ok = all(np.array_equal(block_manager.slot_mapping(t, s, c), engine.slot_mapping(t, s, c))
                   and block_manager.slot_mapping(t, s, c).dtype == np.int32 for t, s, c in windows)
    ok = first is None and len(ours) == len(theirs) and slots_ok
    if ok:
        verdict = f"{len(ours)} calls and {len(windows)} slot lookups agree with the engine's"
    elif first is not None:
        verdict = f"call {first}, {ours[first][0][0]}{ours[first][0][1:]}: result or state differs from the engine's"
    else:
        verdict = "slot_mapping differs from the engine's"
    return Stage("(c) BlockManager, slot_mapping (Ex. 6.1, 6.2)", f"{len(run.calls)} calls replayed",
                 time.perf_counter() - start, verdict, ok)


def main() -> bool:
    device = "cuda" if cuda_available() else "cpu"
    model_dir = resolve_model("default")
    tok = load_tokenizer(model_dir)
    start = time.perf_counter()
    model = Model(model_dir, device, MAX_TOKENS)
    build_s = time.perf_counter() - start
    cfg, width = model.cfg, 2 if device == "cuda" else 4
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    per_block = bytes_per_block(cfg, width)
    longest = max(len(p) for p in prompts) + MAX_NEW_TOKENS
    print(f"model: {model_dir} ({cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} K/V heads x "
          f"{cfg.head_dim}); device: {device}\n"
          f"prompts: {len(prompts)} of {[len(p) for p in prompts]} tokens, greedy, at most {MAX_NEW_TOKENS} new "
          f"tokens each; sequence {CANCEL[0]} is cancelled after step {CANCEL[1]}\n"
          f"pool: {NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens = {NUM_BLOCKS * BLOCK_SIZE} slots, "
          f"{per_block:,} bytes per block, {NUM_BLOCKS * per_block / 1e6:.1f} MB\n"
          f"a contiguous cache for the same {len(prompts)} sequences needs {len(prompts)} x {longest} = "
          f"{len(prompts) * longest} slots ({len(prompts) * longest * per_block / BLOCK_SIZE / 1e6:.1f} MB)\n"
          f"below, 'pool' shows the owner of each physical block ('.': free); in a block table, 5->3* means "
          f"logical block 5 is in physical block 3, which another sequence held earlier\n"
          f"warm-up (one prefill, two decode steps): {ch05.warm_up(model, prompts[0]) * 1e3:.0f} ms\n")

    try:
        run = run_together(model, tok, prompts, on_snapshot=printer({0, MAX_NEW_TOKENS - 2}))
    except OutOfBlocks:  # a model that never says its stop token (random weights) runs every answer to the end
        num_blocks = sum(blocks_for(len(p) + MAX_NEW_TOKENS) for p in prompts)
        print(f"\nthese answers outgrow {NUM_BLOCKS} blocks (none stopped early): again, with {num_blocks}\n")
        run = run_together(model, tok, prompts, num_blocks, on_snapshot=printer({0, MAX_NEW_TOKENS - 2}))
    stops = ch05.stop_ids(tok, cfg)
    for seq, text in enumerate(PROMPTS):
        short = text if len(text) < 40 else text[:37] + "..."
        print(f"  seq {seq} ({run.ended[seq]}, {len(run.tokens[seq])} tokens) {short!r}\n"
              f"      -> {answer_text(tok, run.tokens[seq], stops)}")
    steps = run.snapshots[-1].step
    print(f"\n{steps} decode steps for {len(prompts)} sequences in {run.seconds:.1f} s (prefills included)\n")

    stages = [Stage(f"engine Model on {device}", f"{sum(r.nbytes for r in model.weight_regions) / 1e6:.0f} MB "
                    f"of {'bf16' if device == 'cuda' else 'f32'} weights", build_s),
              Stage("prefill 5, decode together", f"{steps} steps, pool of {run.num_blocks}", run.seconds),
              check_alone(model, tok, run), check_consistency(run), check_exercises(run)]
    print_table(stages)
    ok = all(s.ok is not False for s in stages)
    print("checkpoint 6:", "PASSED" if ok else "FAILED")
    return ok
