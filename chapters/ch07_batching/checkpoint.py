"""`make chapter-7`: chat prompts through ONE engine — continuous batching against static batching.

    make chapter-7                  # python -m chapters 7: on the GPU if CuPy sees one, else on the CPU
    make chapter-7 IMPL=student     # the same, with your admit (7.1) and choose_victim (7.2) in the Scheduler
    make chapter-7 FULL=1           # all 32 requests, the chapter text's run (python -m chapters 7 --full)

The requests (greedy; request i may generate MAX_TOKENS[i % 5] tokens, 24 on average, and stops earlier
at <|im_end|>) run through one LLM with MAX_NUM_SEQS slots and a pool of NUM_BLOCKS blocks, too small for
eight growing answers at once, so the scheduler must preempt. By default the first DEFAULT_REQUESTS of
the 32 prompts, so that the checkpoint fits a shared 2-core machine; --full runs all 32. Three runs:
  continuous  all 32 submitted at once with llm.generate: a finished request's slot is refilled the
              very next step (the slot timeline below shows it);
  static      the same requests in fixed batches of MAX_NUM_SEQS, each batch stepped until its last
              request is done before the next batch is submitted;
  alone       each request by itself: by default the ALONE_CHECKED requests most likely to go wrong (every
              preempted one, then the first ones), with --full all of them.
Then four checks:
  (a) every continuous answer checked equals the same prompt run alone (on a GPU, bf16 GEMMs of other
      batch sizes may flip a near tie: there, 90% of the tokens must agree);
  (b) the static answers too;
  (c) after each run the pool is whole again: every block free, no block table left;
  (d) the run's scheduling, step by step, equals a replay without a model (the same prompt and answer
      lengths) through a fresh copy of the engine's scheduler.py: with --impl student your admit and
      choose_victim made the run's decisions, the engine's own made the replay's.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from types import ModuleType

from chapters.ch01_map.checkpoint import Stage
from chapters.ch03_prefill.checkpoint import print_table
from chapters.ch05_decode import checkpoint as ch05
from chapters.ch06_paged_kv.checkpoint import GPU_AGREEMENT, token_agreement
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.sequence import Sequence
from tinyvllm.formats.checkpoints import resolve_model
from tinyvllm.model.backend import cuda_available

PROMPTS = ch05.PROMPTS + [
    "Why is the sea salty?", "Write a haiku about autumn.", "List three prime numbers.", "What is Python?",
    "Translate 'good morning' to French.", "How many legs does a spider have?", "Give me a synonym for happy.",
    "What does a CPU do?", "Tell me a fun fact about cats.", "Spell 'necessary' backwards.",
    "What is the boiling point of water?", "Suggest a name for a dog.", "What is the largest planet?",
    "Who wrote Romeo and Juliet?", "Is a tomato a fruit?", "Name an ocean.", "What color is the sky?",
    "How many days are in a week?", "Define gravity in one sentence.", "What is 10 times 3?",
    "Recommend a book.", "What do bees make?", "Say goodbye in Spanish.", "What is the opposite of cold?",
    "Name a musical instrument.", "How do plants make food?", "What is the freezing point of water?",
    "Give me a word that rhymes with cat."]
MAX_TOKENS = (8, 16, 24, 32, 40)  # request i: MAX_TOKENS[i % 5], so lengths differ as real requests' do
DEFAULT_REQUESTS = 16             # without --full: two batches' worth, still enough to preempt
ALONE_CHECKED = 8                 # without --full: requests run alone for checks (a) and (b), one decode step
                                  # per token each: the checkpoint's slowest part, so the preempted ones first
MAX_NUM_SEQS = 8                  # slots: sequences in one step
NUM_BLOCKS = 28                   # 8 prompts take 3 blocks each; growing to 4 or 5, they cannot all fit
TIMELINE_WIDTH = 100              # steps shown in the printed timeline
                                  # (one flipped near tie changes the rest of that answer; a random-weight
                                  # model, as on a GPU server without the default model, has many: 96% measured)


@dataclass
class Run:
    """One way of running the requests: their tokens, and the engine's trace of every step."""
    name: str
    tokens: list[list[int]]    # request i's output ids
    seq_ids: list[int]         # request i's sequence id in the engine (the trace speaks in these)
    trace: list[dict]          # per step: prefill, decode and preempted sequence ids, free blocks after it
    seconds: float
    waves: list[list[int]]     # the requests submitted together, each wave once the engine was empty
    prompt_lens: list[int]
    max_num_seqs: int          # the scheduler's limits in this run
    budget: int                # max_num_batched_tokens
    long_prefill: int          # long_prefill_token_threshold: the most tokens of one prompt per step

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def preemptions(self) -> int:
        return sum(len(t.preempted) for t in self.trace)

    @property
    def slot_use(self) -> float:
        """The fraction of the step x slot grid that ran a sequence (prefill or decode)."""
        busy = sum(len(t.prefill) + len(t.decode) for t in self.trace)
        return busy / (len(self.trace) * self.max_num_seqs)


def chat_prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def request_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)]) for i in range(n)]


def make_llm(device: str) -> LLM:
    """Prefix caching off: check (d) replays the block counts of a pool without it (and the runs must not
    share blocks with each other, or the later ones would have less to compute)."""
    return LLM(resolve_model("default"), device=device, num_blocks=NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS,
               enable_prefix_caching=False)


def warm_up(llm: LLM, prompts: list[list[int]]) -> float:
    """Eight requests of 1 to 8 tokens: decode steps of every batch size up to 8 (on a GPU, every CUDA
    graph bucket up to 8 is captured here, not in the timed runs; on a CPU the BLAS threads wake up)."""
    start = time.perf_counter()
    llm.generate(prompts[:MAX_NUM_SEQS], [SamplingParams(temperature=0, max_tokens=n + 1)
                                          for n in range(MAX_NUM_SEQS)])
    return time.perf_counter() - start


def run_continuous(llm: LLM, prompts: list[list[int]], params: list[SamplingParams],
                   use_tqdm: bool = sys.stderr.isatty()) -> Run:  # no bar in a log (make course, CI)
    """Every request submitted at once: the scheduler refills a slot as soon as it frees."""
    engine, first_step = llm.engine, llm.engine.steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    seconds = time.perf_counter() - start
    trace = engine.trace_since(first_step)
    first_id = min(s for t in trace for s in t.prefill)  # request 0 is admitted first; ids count up
    return Run("continuous", [o.token_ids for o in outs], [first_id + i for i in range(len(prompts))], trace,
               seconds, [list(range(len(prompts)))], *limits(llm, prompts))


def run_static(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], batch: int) -> Run:
    """Fixed batches: submit `batch` requests, step until the engine is empty, then the next batch."""
    engine, first_step = llm.engine, llm.engine.steps
    waves = [list(range(i, min(i + batch, len(prompts)))) for i in range(0, len(prompts), batch)]
    seqs: list[Sequence] = []
    start = time.perf_counter()
    for wave in waves:
        seqs += [llm.add_request(prompts[i], params[i]) for i in wave]
        while engine.has_work():
            engine.step()
    seconds = time.perf_counter() - start
    return Run(f"static, batches of {batch}", [list(s.output_ids) for s in seqs], [s.seq_id for s in seqs],
               engine.trace_since(first_step), seconds, waves, *limits(llm, prompts))


def limits(llm: LLM, prompts: list[list[int]]) -> tuple[list[int], int, int, int]:
    """What a replay of a run needs besides its tokens: the prompt lengths and the scheduler's limits."""
    sched = llm.engine.scheduler
    return [len(p) for p in prompts], sched.max_num_seqs, sched.max_num_batched_tokens, \
        sched.long_prefill_token_threshold


def to_check(runs: list[Run], count: int) -> list[int]:
    """The requests to run alone: every one preempted in a run (recomputed from its tokens: the likeliest to
    go wrong), then the first ones, `count` in all (at least every preempted one)."""
    preempted = {i for r in runs for i, seq in enumerate(r.seq_ids) if any(seq in t.preempted for t in r.trace)}
    rest = [i for i in range(len(runs[0].tokens)) if i not in preempted]
    return sorted(preempted) + rest[:max(0, count - len(preempted))]


def run_alone(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [llm.generate([p], s)[0].token_ids for p, s in zip(prompts, params)]


# ---- the slot timeline ----

def cell(step: dict, seq: int) -> str:
    if seq in step.prefill:
        return "P"
    if seq in step.decode:
        return "."
    return "x" if seq in step.preempted else " "


def timeline(run: Run, labels: list[str], width: int = TIMELINE_WIDTH) -> list[str]:
    """One row per request, one column per step: P prefill, . decode, x preempted, blank waiting or done."""
    shown = run.trace[:width]
    ruler = "".join(str(t // 10 % 10) if t % 10 == 0 else " " for t in range(len(shown)))
    rows = [f"{'':28} {ruler}  step / 10"]
    for i, (seq, label) in enumerate(zip(run.seq_ids, labels)):
        short = label if len(label) <= 24 else label[:21] + "..."
        rows.append(f"{i:2d} {short:<25}|{''.join(cell(t, seq) for t in shown)}| {len(run.tokens[i]):2d} tokens")
    if len(run.trace) > width:
        rows.append(f"{'':28} ... {len(run.trace) - width} more steps not shown")
    return rows


# ---- the checks ----

def check_answers(name: str, run: Run, checked: list[int], alone: list[list[int]], device: str) -> Stage:
    """The checked requests' tokens against their runs alone: identical on the CPU, >= GPU_AGREEMENT (90%) of
    the tokens on a GPU."""
    differ, agree = token_agreement([run.tokens[i] for i in checked], alone)
    ok = not differ if device == "cpu" else agree >= GPU_AGREEMENT
    verdict = "identical" if not differ else \
        f"requests {[checked[d] for d in differ][:6]} differ ({agree:.1%} of tokens agree)"
    return Stage(name, f"{len(checked)} of {len(run.tokens)} answers", 0.0, f"each prompt alone: {verdict}", ok)


def check_pool(llm: LLM, runs: list[Run]) -> Stage:
    """(c) the pool after every run (the last run leaves it as the check finds it now)."""
    blocks, engine = llm.engine.scheduler.block_manager, llm.engine
    ends = [r.trace[-1].free_blocks for r in runs]
    ok = all(e == NUM_BLOCKS for e in ends) and blocks.num_free == NUM_BLOCKS and not blocks.tables \
        and not engine.has_work()
    return Stage("(c) the pool after each run", f"{NUM_BLOCKS} blocks", 0.0,
                 f"free after each run: {ends}; tables left: {len(blocks.tables)}", ok)


def engine_scheduler() -> ModuleType:
    """A fresh copy of tinyvllm/engine/scheduler.py: the engine's own admit and choose_victim, even after
    --impl student has replaced them in the imported module."""
    spec = importlib.util.find_spec("tinyvllm.engine.scheduler")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay(module: ModuleType, run: Run, num_blocks: int = NUM_BLOCKS) -> list[tuple]:
    """The run's scheduling without a model, by module.Scheduler: each request generates exactly as many
    tokens as it did in the run; the scheduler takes the blocks itself, as it does in the engine, and its
    plan goes nowhere. Per step: (prefill ids, decode ids, preempted ids, free blocks after it)."""
    sched = module.Scheduler(num_blocks, run.max_num_seqs, run.budget, long_prefill_token_threshold=run.long_prefill)
    steps = []
    for wave in run.waves:
        for i in wave:
            sched.add(Sequence(run.seq_ids[i], [0] * run.prompt_lens[i], SamplingParams(temperature=0),
                               len(run.tokens[i]), set(), decoder=None))
        while sched.has_work():
            plan = sched.schedule()
            done = [s for s in plan.prefills if s.num_computed == len(s)]   # a chunk mid-prompt samples nothing
            for seq in done + plan.decodes:
                seq.output_ids.append(0)
                if len(seq.output_ids) == seq.max_tokens:
                    sched.finish(seq)
            steps.append(([s.seq_id for s in plan.prefills], [s.seq_id for s in plan.decodes],
                          [s.seq_id for s in plan.preempted], sched.block_manager.num_free))
    return steps


def check_scheduling(runs: list[Run]) -> Stage:
    """(d) every step of every run against the engine's scheduler replayed without a model."""
    start, module, differ = time.perf_counter(), engine_scheduler(), []
    for run in runs:
        ours = [(t.prefill, t.decode, t.preempted, t.free_blocks) for t in run.trace]
        theirs = replay(module, run)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is not None or len(ours) != len(theirs):
            differ.append(f"{run.name}: step {first if first is not None else min(len(ours), len(theirs))}")
    steps = sum(len(r.trace) for r in runs)
    verdict = "every step identical" if not differ else "differs at " + "; ".join(differ)
    return Stage("(d) scheduling (Ex. 7.1, 7.2)", f"{steps} steps replayed", time.perf_counter() - start,
                 f"engine's scheduler.py without a model: {verdict}", not differ)


def print_throughput(runs: list[Run]) -> None:
    """Steps, slot use and preemptions first: the scheduler's doing, the same on every run and machine.
    Seconds and tokens/s after them: wall-clock, they move with the machine and whatever else it runs."""
    header = ("", "steps", "slots busy", "preemptions", "output tokens", "seconds*", "tokens/s*")
    rows = [(r.name, str(len(r.trace)), f"{r.slot_use:.0%}", str(r.preemptions), str(r.output_tokens),
             f"{r.seconds:.1f}", f"{r.tokens_per_s:.1f}") for r in runs]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]))


def verdict(static: Run, continuous: Run, loads: tuple[float, float]) -> list[str]:
    """The headline (steps and slot use: deterministic), then tokens/s with the machine's load beside it."""
    cores = os.cpu_count() or 1
    busy = max(loads) > cores
    return [
        f"continuous batching: {len(static.trace) / len(continuous.trace):.2f}x fewer steps "
        f"({len(continuous.trace)} against {len(static.trace)}), slots busy {continuous.slot_use:.0%} against "
        f"{static.slot_use:.0%}, for the same {continuous.output_tokens} tokens (the same on every run)",
        f"* wall-clock: {continuous.tokens_per_s / static.tokens_per_s:.2f}x the tokens per second here. On a CPU a "
        "step's cost grows with its rows, so fewer steps buy less time than on a GPU, and the ratio moves from run to run",
        f"  load average (1 min) before and after the runs: {loads[0]:.1f}, {loads[1]:.1f} on {cores} cores"
        + (": ABOVE the core count, other programs shared the CPU; read the tokens/s as noise, not as batching"
           if busy else ""),
    ]


def main(full: bool = False) -> bool:
    device = "cuda" if cuda_available() else "cpu"
    load_at_start, start = os.getloadavg()[0], time.perf_counter()
    llm = make_llm(device)
    load_s = time.perf_counter() - start
    prompts = chat_prompts(llm)[:len(PROMPTS) if full else DEFAULT_REQUESTS]
    params = request_params(len(prompts))
    print(f"model: {llm.model_dir}; device: {device}\n"
          + ("" if full else f"the first {len(prompts)} of the {len(PROMPTS)} requests (--full, or make chapter-7 "
                             f"FULL=1, runs all {len(PROMPTS)}: the chapter text's run)\n") +
          f"{len(prompts)} chat prompts of {min(map(len, prompts))} to {max(map(len, prompts))} tokens, greedy, "
          f"max_tokens {', '.join(map(str, MAX_TOKENS))} in turn (stopping earlier at a stop token)\n"
          f"one LLM: max_num_seqs {MAX_NUM_SEQS}, a pool of {NUM_BLOCKS} blocks of 16 tokens\n"
          f"warm-up (8 requests of 1 to 8 tokens): {warm_up(llm, prompts):.1f} s\n")

    continuous = run_continuous(llm, prompts, params)
    print("\ncontinuous batching, one column per step (P prefill, . decode, x preempted, blank: waiting or done):")
    print("\n".join(timeline(continuous, PROMPTS)))
    static = run_static(llm, prompts, params, MAX_NUM_SEQS)
    print(f"\n{len(prompts)} requests, {MAX_NUM_SEQS} slots:")
    print_throughput([static, continuous])
    print("\n".join(verdict(static, continuous, (load_at_start, os.getloadavg()[0]))) + "\n")
    for i in range(len(ch05.PROMPTS)):
        text = llm.tokenizer.decode([t for t in continuous.tokens[i] if t not in llm.stop_token_ids])
        print(f"  {PROMPTS[i]!r} -> {text.strip()!r}")
    checked = to_check([continuous, static], len(prompts) if full else ALONE_CHECKED)
    print("\nnow every request alone, for checks (a) and (b)\n" if full else f"\nnow requests {checked} alone, for "
          f"checks (a) and (b) (every preempted one, {len(checked)} in all; --full: every request)\n")
    start = time.perf_counter()
    alone = run_alone(llm, [prompts[i] for i in checked], [params[i] for i in checked])
    alone_s = time.perf_counter() - start

    runs = [continuous, static]
    stages = [Stage(f"LLM on {device}", f"{NUM_BLOCKS} blocks, {MAX_NUM_SEQS} slots", load_s),
              Stage("continuous: llm.generate", f"{len(continuous.trace)} steps", continuous.seconds),
              Stage(f"static: batches of {MAX_NUM_SEQS}", f"{len(static.trace)} steps", static.seconds),
              Stage("each prompt alone", f"{len(checked)} runs", alone_s),
              check_answers("(a) continuous answers", continuous, checked, alone, device),
              check_answers("(b) static answers", static, checked, alone, device),
              check_pool(llm, runs),
              check_scheduling(runs)]
    print_table(stages)
    ok = all(s.ok is not False for s in stages)
    print("checkpoint 7:", "PASSED" if ok else "FAILED")
    return ok
