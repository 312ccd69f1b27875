"""Chapter 7 figures, from real runs of the default model on the CPU (`make figures`; the notebook calls the
same functions): the checkpoint's workload run continuously and in static batches, decode throughput
against the number of sequences per step, and the prefix cache on a shared system prompt."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure  # no pyplot: the same code draws for files (Agg) and notebooks
from matplotlib.patches import Patch

from chapters.ch07_batching import checkpoint, live_page, server_demo
from tinyvllm import LLM, SamplingParams
from tinyvllm.engine.engine import Engine
from tinyvllm.engine.engine_config import MAX_STEP_TOKENS
from tinyvllm.formats.checkpoints import resolve_model
from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.runner import ModelRunner
from tinyvllm.model.step_plan import BLOCK_SIZE

CONCURRENCY = (1, 2, 4, 8, 16, 32)   # max_num_seqs for the throughput figure
THROUGHPUT_TOKENS = 8                # output tokens per request there (ignore_eos: exactly that many)
ROUNDS = 2                           # each size runs this many times; the best run counts
SYSTEM_PROMPT = (
    "You are the help desk of a small hardware store. Answer in one or two short sentences, in plain words. "
    "The store sells tools, paint, garden supplies, screws, nails, glue and light bulbs, and it cuts keys "
    "while you wait. It opens at eight in the morning and closes at six, every day except Sunday. If a "
    "question is not about the store or its products, say politely that you can only help with the store.")
SHARED_QUESTIONS = tuple(checkpoint.PROMPTS[:16])

WAITING, PREFILL, DECODE, PREEMPTED = 1, 2, 3, 4
STATE_COLORS = ["white", "#E3E3E3", "#C44E52", "#4C72B0", "black"]  # none, waiting, prefill, decode, preempted
RUN_COLORS = {"continuous": "#4C72B0", "static": "#DD8452"}


# ---- the runs ----

@lru_cache(maxsize=1)
def workload() -> tuple[checkpoint.Run, checkpoint.Run]:
    """The checkpoint's 32 requests on the CPU, one LLM (8 slots, 28 blocks): continuous, then static."""
    llm = checkpoint.make_llm("cpu")
    prompts, params = checkpoint.chat_prompts(llm), checkpoint.request_params(len(checkpoint.PROMPTS))
    checkpoint.warm_up(llm, prompts)
    continuous = checkpoint.run_continuous(llm, prompts, params, use_tqdm=False)
    return continuous, checkpoint.run_static(llm, prompts, params, checkpoint.MAX_NUM_SEQS)


@lru_cache(maxsize=1)
def cpu_llm() -> LLM:
    """The default model on the CPU, for engines built on it with other settings (a pool of 256 blocks, step
    buffers of MAX_STEP_TOKENS rows: the figures' batches of up to 256 sequences and their budgets fit)."""
    return LLM(resolve_model("default"), device="cpu", num_blocks=256, max_num_batched_tokens=MAX_STEP_TOKENS["cpu"])


def engine_on(llm: LLM, max_num_seqs: int = 256, prefix_caching: bool = False, num_blocks: int = 256,
              budget: int | None = None) -> Engine:
    """A fresh Engine (empty pool, new scheduler) over the LLM's model: settings without reloading weights
    (a step budget at most the model's step buffers)."""
    budget = budget or llm.engine.config.max_num_batched_tokens   # one prompt may take all of it: no long-prefill cap
    config = replace(llm.engine.config, max_num_seqs=max_num_seqs, enable_prefix_caching=prefix_caching,
                     num_blocks=num_blocks, max_num_batched_tokens=budget, long_prefill_token_threshold=budget)
    runner = ModelRunner(llm.model, PagedKVPool(llm.model_config, llm.model.ops, num_blocks))
    return Engine(config, runner, llm.tokenizer)


@lru_cache(maxsize=1)
def measure_throughput(concurrency=CONCURRENCY, tokens: int = THROUGHPUT_TOKENS, rounds: int = ROUNDS) -> list[dict]:
    """For each c: c of the checkpoint's prompts, max_num_seqs = c, exactly `tokens` output tokens each.
    Output tokens per second of the whole run (its prefill included) and of its decode steps alone
    (c / the median step). The sizes take turns, `rounds` times, and each keeps its best round: a
    neighbour that loads this shared machine for a while then slows one round, not one size."""
    llm = cpu_llm()
    prompts = checkpoint.chat_prompts(llm)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    best = {c: {"c": c, "seconds": float("inf"), "step_s": float("inf")} for c in concurrency}
    for _ in range(rounds):
        for c in concurrency:
            engine = engine_on(llm, c)
            for p in prompts[:c]:
                engine.add_request(p, params)
            time.sleep(0.3)  # the BLAS threads of the last run stop spinning
            decode_s, start = [], time.perf_counter()
            while engine.has_work():
                t0 = time.perf_counter()
                engine.step()
                if not engine.trace[-1].prefill:
                    decode_s.append(time.perf_counter() - t0)
            seconds = time.perf_counter() - start
            best[c]["seconds"] = min(best[c]["seconds"], seconds)
            best[c]["step_s"] = min(best[c]["step_s"], float(np.median(decode_s)))
    return [{**b, "tokens_per_s": b["c"] * tokens / b["seconds"], "decode_tokens_per_s": b["c"] / b["step_s"]}
            for b in best.values()]


def hit_rate_of(engine: Engine) -> float:
    """The prefix cache's hit rate so far: prompt tokens found cached / prompt tokens looked up."""
    stats = engine.scheduler.cache_stats
    return stats.hits / stats.queries


@lru_cache(maxsize=1)
def measure_prefix_cache(questions=SHARED_QUESTIONS) -> dict:
    """The questions behind one system prompt, arriving one per step (each generates one token), through
    an engine with prefix caching and one without; and all of them arriving in the same step."""
    llm = cpu_llm()
    prompts = [llm.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                                  {"role": "user", "content": q}]) for q in questions]
    one = SamplingParams(temperature=0, max_tokens=1)
    common = next((i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1), len(prompts[0]))
    out = {"prompt_tokens": [len(p) for p in prompts], "common_tokens": common}
    for caching in (False, True):
        engine, seqs, hit_rate = engine_on(llm, prefix_caching=caching), [], []
        start = time.perf_counter()
        for p in prompts:  # one arrival per step: each finds the blocks of those before it
            seqs.append(engine.add_request(p, one))
            engine.step()
            if caching:
                hit_rate.append(hit_rate_of(engine))
        key = "cached" if caching else "plain"
        out[key] = {"computed": [len(s.prompt_ids) - s.num_cached for s in seqs], "hit_rate": hit_rate,
                    "seconds": time.perf_counter() - start}
    engine = engine_on(llm, prefix_caching=True)
    for p in prompts:  # all in one step: nothing is cached yet when they are admitted together
        engine.add_request(p, one)
    engine.step()
    out["together_hit_rate"] = hit_rate_of(engine)
    return out


# ---- the figures ----

def state_grid(run: checkpoint.Run) -> np.ndarray:
    """(requests, steps) of WAITING / PREFILL / DECODE / PREEMPTED (0: done)."""
    grid = np.zeros((len(run.seq_ids), len(run.trace)), np.int8)
    row = {seq: i for i, seq in enumerate(run.seq_ids)}
    for t, step in enumerate(run.trace):
        for state, key in ((PREFILL, "prefill"), (DECODE, "decode"), (PREEMPTED, "preempted")):
            for seq in getattr(step, key):
                grid[row[seq], t] = state
    for i in range(len(grid)):  # every request is there from step 0 (static: held back until its batch)
        grid[i, :int(np.argmax(grid[i] == PREFILL))] = WAITING
    for i, t in zip(*np.nonzero(grid == PREEMPTED)):  # preempted: waiting again until its next prefill
        back = t + 1 + int(np.argmax(grid[i, t + 1:] == PREFILL))
        grid[i, t + 1:back] = WAITING
    return grid


def draw_gantt() -> Figure:
    """Every request's life, step by step: continuous batching above, static batches of 8 below."""
    runs = workload()
    steps = max(len(r.trace) for r in runs)
    fig = Figure(figsize=(13, 10))
    axes = fig.subplots(2, 1, sharex=True)
    cmap = ListedColormap(STATE_COLORS)
    for ax, run in zip(axes, runs):
        grid = np.zeros((len(run.seq_ids), steps), np.int8)
        grid[:, :len(run.trace)] = state_grid(run)
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=len(STATE_COLORS) - 1, aspect="auto", interpolation="nearest",
                  extent=(-0.5, steps - 0.5, len(run.seq_ids) - 0.5, -0.5))
        rows, cols = np.nonzero(grid == PREEMPTED)
        ax.scatter(cols, rows, marker="x", s=40, color="#C44E52", lw=2, zorder=3)
        ax.axvline(len(run.trace) - 0.5, color="black", lw=1)
        ax.annotate(f"{len(run.trace)} steps ", (len(run.trace) - 0.5, 0.02), xycoords=("data", "axes fraction"),
                    ha="right", fontsize=9)
        ax.set_yticks(range(0, len(run.seq_ids), 4))
        ax.set_ylabel("request")
        ax.set_title(f"{run.name}: {len(run.trace)} steps, {run.slot_use:.0%} of the "
                     f"{checkpoint.MAX_NUM_SEQS} slots busy, {run.preemptions} preemptions, "
                     f"{run.tokens_per_s:.1f} output tokens/s on this CPU", fontsize=10)
    axes[1].set_xlabel("engine step")
    labels = ["waiting", "prefill (admitted)", "decode", "preempted (blocks freed; recomputed later)"]
    fig.legend([Patch(facecolor=c, edgecolor="#999999") for c in STATE_COLORS[1:4]] +
               [axes[0].scatter([], [], marker="x", color="#C44E52", lw=2)], labels, loc="lower center", ncol=4,
               fontsize=9, frameon=False)
    fig.suptitle(f"the checkpoint's {len(runs[0].seq_ids)} requests through one engine: "
                 f"{checkpoint.MAX_NUM_SEQS} slots, a pool of {checkpoint.NUM_BLOCKS} blocks, max_tokens "
                 f"{'/'.join(map(str, checkpoint.MAX_TOKENS))} in turn (SmolLM2-135M, CPU)", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def draw_pool_usage() -> Figure:
    """Blocks in use and sequences running after every step, for both runs; preemptions marked."""
    runs = workload()
    fig = Figure(figsize=(12, 6.5))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1.4, 1]})
    for run in runs:
        color = RUN_COLORS[run.name.split(",")[0]]
        used = [checkpoint.NUM_BLOCKS - t.free_blocks for t in run.trace]
        running = [len(t.prefill) + len(t.decode) for t in run.trace]
        top.step(range(len(used)), used, where="mid", color=color, lw=1.4, label=run.name)
        bottom.step(range(len(running)), running, where="mid", color=color, lw=1.4, label=run.name)
        dry = [t for t, step in enumerate(run.trace) if step.preempted]
        top.scatter(dry, [checkpoint.NUM_BLOCKS] * len(dry), marker="v", s=60, color="#C44E52", zorder=3,
                    label=f"{run.name}: the pool ran dry, a sequence was preempted" if dry else None)
    top.axhline(checkpoint.NUM_BLOCKS, color="black", ls="--", lw=1)
    top.text(0, checkpoint.NUM_BLOCKS + 0.4, f"the pool: {checkpoint.NUM_BLOCKS} blocks", fontsize=8, va="bottom")
    top.set(ylabel="blocks in use after the step", ylim=(0, checkpoint.NUM_BLOCKS + 4))
    top.legend(fontsize=8, loc="lower right")
    bottom.axhline(checkpoint.MAX_NUM_SEQS, color="black", ls="--", lw=1)
    bottom.set(xlabel="engine step", ylabel="sequences in the step", ylim=(0, checkpoint.MAX_NUM_SEQS + 1))
    top.set_title("the KV cache pool during the checkpoint's workload: continuous batching keeps it (and the "
                  "slots) full;\nstatic batches drain before the next one starts", fontsize=10)
    fig.tight_layout()
    return fig


def draw_throughput_vs_concurrency() -> Figure:
    """Output tokens per second on this CPU as more sequences share each step."""
    results = measure_throughput()
    c = [r["c"] for r in results]
    fig = Figure(figsize=(9, 4.8))
    ax = fig.subplots()
    for key, label, color in (("decode_tokens_per_s", "decode steps only: c / median step time", "#4C72B0"),
                              ("tokens_per_s", "whole run: prefill + decode, wall clock", "#DD8452")):
        values = [r[key] for r in results]
        ax.plot(c, values, "o-", color=color, label=label)
        for x, y in zip(c, values):
            ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8,
                        color=color)
    for r in results:
        ax.annotate(f"{r['step_s'] * 1e3:.0f} ms/step", (r["c"], 0), textcoords="offset points", xytext=(0, 4),
                    ha="center", fontsize=7, color="#555555")
    ax.set_xscale("log", base=2)
    ax.set_xticks(c, [str(x) for x in c])
    ax.set(xlabel="max_num_seqs = sequences decoded together (c requests submitted)",
           ylabel="output tokens / s", ylim=(0, None))
    ax.set_title(f"SmolLM2-135M on this CPU (NumPy, float32): c requests of ~36 prompt tokens, "
                 f"{THROUGHPUT_TOKENS} output tokens each (best of {ROUNDS} runs)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def draw_prefix_hits() -> Figure:
    """Left: the cumulative prefix-cache hit rate as requests sharing a system prompt arrive.
    Right: prompt tokens the prefill actually computed, per request, with and without the cache."""
    m = measure_prefix_cache()
    n = np.arange(1, len(m["prompt_tokens"]) + 1)
    fig = Figure(figsize=(13, 4.8))
    left, right = fig.subplots(1, 2)
    left.plot(n, np.array(m["cached"]["hit_rate"]) * 100, "o-", color="#55A868", label="one arrival per step")
    left.axhline(m["together_hit_rate"] * 100, color="#C44E52", ls="--", lw=1)
    left.text(n[-1], m["together_hit_rate"] * 100 + 2, f"all {n[-1]} admitted in the same step: "
              f"{m['together_hit_rate']:.0%}", ha="right", fontsize=8, color="#C44E52")
    common = m["common_tokens"]
    left.set(xlabel="requests so far", ylabel="prompt tokens found in the cache (%)", ylim=(-5, 100))
    left.set_title(f"hit rate: tokens found / prompt tokens looked up, so far\n(every prompt starts with the same "
                   f"{common} tokens: {common // BLOCK_SIZE} full blocks of {BLOCK_SIZE})", fontsize=10)
    left.legend(fontsize=8, loc="center right")
    width = 0.4
    right.bar(n - width / 2, m["plain"]["computed"], width, color="#8C8C8C",
              label=f"no prefix caching: {sum(m['plain']['computed']):,} tokens, {m['plain']['seconds']:.1f} s in all")
    right.bar(n + width / 2, m["cached"]["computed"], width, color="#55A868",
              label=f"prefix caching: {sum(m['cached']['computed']):,} tokens, {m['cached']['seconds']:.1f} s in all")
    right.set(xlabel="request", ylabel="prompt tokens prefill computed",
              ylim=(0, 1.4 * max(m["plain"]["computed"])))  # headroom: the legend sits above the bars
    right.set_xticks(n)
    right.set_title("prefill work per request (the first one fills the cache for the rest)", fontsize=10)
    right.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"{n[-1]} questions behind one system prompt, SmolLM2-135M on this CPU; each request generates "
                 "one token, so its step is its prefill", fontsize=11)
    fig.tight_layout()
    return fig


def draw_throughput_h200() -> Figure:
    """The H200 throughput benchmark, from the newest bench/results/throughput-*.json with transformers in it
    (measured on a GPU; runs with --skip-transformers have no peer to draw)."""
    results_dir = Path(__file__).resolve().parents[2] / "bench" / "results"
    path = [p for p in sorted(results_dir.glob("throughput-*.json"))
            if "transformers_continuous" in json.loads(p.read_text())["results"]][-1]
    results = json.loads(path.read_text())["results"]
    rows = [("tinyvllm\ncontinuous, 256", "tinyvllm"), ("tinyvllm\ncontinuous, 64", "continuous_64"),
            ("tinyvllm\nstatic, 64", "static_64"), ("transformers\ncontinuous", "transformers_continuous"),
            ("transformers\npadded, 64", "transformers_padded_64")]
    rows = [(label, results[key]["tokens_per_s"]) for label, key in rows if "tokens_per_s" in results.get(key, {})]
    fig = Figure(figsize=(9, 3.8))
    ax = fig.subplots()
    bars = ax.bar([r[0] for r in rows], [r[1] for r in rows],
                  color=["tab:blue", "tab:blue", "tab:cyan", "tab:gray", "tab:gray"][:len(rows)])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for _, v in rows], fontsize=9)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"256 requests, prompt and output lengths in [100, 1024], Llama-3.2-1B shapes, H200 ({path.name})",
                 fontsize=10)
    fig.tight_layout()
    return fig

def draw_batch_invariance() -> Figure:
    """Greedy tokens of 6 prompts alone and inside a batch of 64, default mode and batch-invariant mode, from
    the newest bench/results/batch_invariance-cuda-*.json (measured on a GPU): where the two answers part."""
    results_dir = Path(__file__).resolve().parents[2] / "bench" / "results"
    path = sorted(results_dir.glob("batch_invariance-cuda-*.json"))[-1]
    result = json.loads(path.read_text())
    n, modes = result["workload"]["max_tokens"], result["modes"]
    fig = Figure(figsize=(9, 3.6))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, (name, label) in zip(axes, [("default", "default"), ("batch_invariant", "batch_invariant=True")]):
        firsts = modes[name]["first_difference"]
        for row, first in enumerate(firsts):
            same = n if first is None else first
            ax.barh(row, same, color="tab:green")
            ax.barh(row, n - same, left=same, color="tab:red")
        ax.set_xlim(0, n)
        ax.set_xlabel("generated token")
        ax.set_title(f"{label}: {modes[name]['same']} of {len(firsts)} answers identical\n"
                     f"(the batch took {modes[name]['batch_seconds']:.2f} s)", fontsize=10)
    axes[0].set_yticks(range(len(firsts)), [f"prompt {t}" for t in result["workload"]["targets"]])
    axes[0].invert_yaxis()
    fig.legend(handles=[Patch(color="tab:green", label="same token as alone"),
                        Patch(color="tab:red", label="from the first difference on")],
               loc="lower center", ncol=2, fontsize=9, bbox_to_anchor=(0.5, -0.06))
    fig.suptitle(f"Greedy, alone vs inside a batch of {result['workload']['batch']} (synthetic Llama 3.2 1B, H200, "
                 f"{path.name})", fontsize=10)
    fig.tight_layout()
    return fig


CHUNK_BUDGET = 96   # tokens per step in the chunked-prefill figure: small enough to see the chunks


@lru_cache(maxsize=1)
def measure_chunked_prefill(budget: int = CHUNK_BUDGET) -> dict:
    """Four short chat requests decoding, then the checkpoint's longest prompt arriving, through an engine
    whose step budget is `budget` tokens: per step, the tokens each sequence computed."""
    llm = cpu_llm()
    engine = engine_on(llm, max_num_seqs=8, budget=budget)
    prompts = checkpoint.chat_prompts(llm)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts[:4]]
    long_prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": " ".join(checkpoint.PROMPTS)}])
    first = engine.steps
    for step in range(200):
        if step == 6:
            seqs.append(engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=8)))
        if not engine.has_work():
            break
        engine.step()
    trace = engine.trace_since(first)
    ids = [s.seq_id for s in seqs]
    grid = np.zeros((len(seqs), len(trace)), np.int32)   # tokens computed per (sequence, step)
    for j, t in enumerate(trace):
        for seq_id, count in zip(t.prefill, t.chunks):
            grid[ids.index(seq_id), j] = count
        for seq_id in t.decode:
            grid[ids.index(seq_id), j] = 1
    return {"grid": grid, "budget": budget, "long_prompt": len(long_prompt), "prompt_lens": [len(s.prompt_ids) for s in seqs]}


def draw_chunked_prefill() -> Figure:
    """Tokens computed per step and sequence under a token budget: decodes first, then the prompt in chunks."""
    m = measure_chunked_prefill()
    grid, budget = m["grid"], m["budget"]
    fig = Figure(figsize=(12, 4.2))
    ax = fig.subplots()
    bottom = np.zeros(grid.shape[1])
    colors = ["#4C72B0", "#55A868", "#8172B2", "#CCB974", "#C44E52"]
    for i, row in enumerate(grid):
        label = (f"request {i} ({m['prompt_lens'][i]}-token prompt)" if i < len(grid) - 1
                 else f"the long prompt ({m['long_prompt']} tokens), arriving at step 6")
        ax.bar(np.arange(grid.shape[1]), row, bottom=bottom, color=colors[i % len(colors)], label=label, width=0.85)
        bottom += row
    ax.axhline(budget, color="black", lw=1, ls="--")
    ax.annotate(f"budget: {budget} tokens per step", (9, budget), ha="left", va="bottom", fontsize=9)
    ax.set_ylim(0, budget * 1.6)
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens computed")
    ax.set_title("chunked prefill: every running request decodes one token per step; the prompts fill what is left "
                 "(SmolLM2-135M, CPU)", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


FIGURES = {
    "ch07_gantt.png": draw_gantt,
    "ch07_pool_usage.png": draw_pool_usage,
    "ch07_throughput_vs_concurrency.png": draw_throughput_vs_concurrency,
    "ch07_prefix_hits.png": draw_prefix_hits,
    "ch07_chunked_prefill.png": draw_chunked_prefill,
    "ch07_throughput_h200.png": draw_throughput_h200,
    "ch07_batch_invariance.png": draw_batch_invariance,
    "ch07_server_batch.png": server_demo.draw_server_batch,
    "ch07_live_page.png": live_page.draw_live_page,
}
