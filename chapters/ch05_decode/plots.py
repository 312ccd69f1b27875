"""Chapter 5 figures, from real decode runs of the default model on the CPU (`make figures`; the notebook
calls the same functions), and the KV cache's size from the models' configs."""
from __future__ import annotations

import statistics
import time
from functools import lru_cache

import numpy as np
from matplotlib.figure import Figure  # no pyplot: the same code draws for files (Agg) and notebooks

from chapters.ch05_decode import checkpoint
from tinyvllm import reference
from tinyvllm.formats.checkpoints import PRESETS, resolve_model
from tinyvllm.formats.config import expected_tensor_shapes, load_config
from tinyvllm.formats.tokenizer import Tokenizer, load_tokenizer
from tinyvllm.model.decode import decode_step
from tinyvllm.model.kv_pool import ContiguousKVCache
from tinyvllm.model.model import Model
from tinyvllm.model.op_timer import timed_ops
from tinyvllm.model.prefill import prefill

PROMPT = checkpoint.PROMPTS[0]
CONTEXTS = [1024, 4096]   # extra context lengths for the step breakdown (the answer's own is added)
STEPS = 5                 # decode steps timed per context; the median of each op is drawn


@lru_cache(maxsize=1)
def engine() -> tuple[Model, Tokenizer]:
    """The default model on the CPU (NumPy twins, float32) and its tokenizer."""
    model_dir = resolve_model("default")
    return Model(model_dir, "cpu", max_num_batched_tokens=checkpoint.MAX_TOKENS), load_tokenizer(model_dir)


@lru_cache(maxsize=4)
def answer(prompt: str = PROMPT) -> checkpoint.Generation:
    """A prompt (the chapter's first by default) answered greedily on the CPU, every step timed."""
    model, tok = engine()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
    checkpoint.warm_up(model, ids)
    cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=len(ids) + checkpoint.MAX_NEW_TOKENS)
    return checkpoint.generate(model, tok, ids, cache, seq=0)


def label(tok: Tokenizer, token: int) -> str:
    return tok.decode([token]).replace("\n", "\\n") or repr(tok.decode_bytes([token]))


def draw_timeline() -> Figure:
    """One generation on the CPU: the prefill's bar, then one bar per decode step, each with its token."""
    _, tok = engine()
    gen = answer()
    durations = [gen.prefill_s] + gen.step_s                   # bar i produces answer token i
    starts = np.concatenate([[0], np.cumsum(durations)[:-1]]) * 1e3
    fig = Figure(figsize=(12.5, 3.6))
    ax = fig.subplots()
    colors = ["#C44E52"] + ["#4C72B0", "#7EA6E0"] * len(gen.step_s)
    ax.barh(0, np.array(durations) * 1e3, left=starts, height=0.5, color=colors[:len(durations)], edgecolor="white")
    for x, w, token in zip(starts, np.array(durations) * 1e3, gen.tokens):
        ax.text(x + w / 2, 0.3, repr(label(tok, token)), rotation=45, ha="left", va="bottom", fontsize=8)
        ax.text(x + w / 2, 0, f"{w:.0f}", ha="center", va="center", fontsize=7, color="white")
    ax.text(starts[0] + 2, -0.4, f"prefill: {len(gen.prompt_ids)} prompt tokens", fontsize=8, color="#C44E52")
    ax.text(starts[1] + 2, -0.4, f"decode: one step per token, median {statistics.median(gen.step_s) * 1e3:.0f} ms",
            fontsize=8, color="#4C72B0")
    ax.set_ylim(-0.6, 1.2)
    ax.set_yticks([])
    ax.set_xlabel("time since the prompt arrived (ms); bars end to end, each timed until its token id is on the host")
    ax.set_title(f"{PROMPT!r} answered by {resolve_model('default').name} on the CPU: each bar is one forward "
                 "pass, labelled with the token it picked (ms inside)", fontsize=10)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def op_times(model: Model, cache: ContiguousKVCache, token: int, steps: int = STEPS) -> dict[str, float]:
    """Median seconds per op over `steps` decode steps at the cache's current length (restored after each),
    with the lm_head's GEMM apart from the layers' and the time between ops as "Python between ops"."""
    runs = []
    for _ in range(steps):
        length = cache.lengths[0]
        with timed_ops(model) as timer:
            start = time.perf_counter()
            decode_step(model, [token], cache, [0])
            wall = time.perf_counter() - start
        cache.lengths[0] = length  # the same step again: the context does not grow
        calls = timer.seconds()
        totals = {"lm_head gemm": calls[-1][1]}  # the step's last op is the lm_head
        for name, s in calls[:-1]:
            key = "layer gemms" if name == "gemm" else name
            totals[key] = totals.get(key, 0.0) + s
        totals["Python between ops"] = wall - sum(s for _, s in calls)
        runs.append(totals)
    return {name: statistics.median(r[name] for r in runs) for name in runs[0]}


@lru_cache(maxsize=1)
def breakdown_by_context() -> dict[int, dict[str, float]]:
    """{context length: median seconds per op} for the answer's real context, then longer ones."""
    model, _ = engine()
    gen = answer()
    ids = gen.prompt_ids + gen.tokens[:-1]
    cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=max(CONTEXTS) + 1)
    prefill(model, ids, cache=cache)
    result = {len(ids) + 1: op_times(model, cache, gen.tokens[-1])}
    for context in CONTEXTS:
        # longer contexts without a long prefill: the slots up to `context` hold this answer's keys and
        # zeros; attention's time depends on how many keys it reads, not on their values
        cache.lengths[0] = context - 1
        result[context] = op_times(model, cache, gen.tokens[-1])
    return result


OP_COLORS = {"layer gemms": "#4C72B0", "lm_head gemm": "#8172B3", "decode_attention": "#C44E52",
             "add_rms_norm": "#55A868", "rope": "#DD8452", "swiglu": "#937860", "store_kv": "#DA8BC3",
             "embedding": "#8C8C8C", "Python between ops": "#CCB974"}


def draw_step_breakdown() -> Figure:
    """Where one CPU decode step's time goes, op by op, at the answer's context and at longer ones."""
    model, _ = engine()
    by_context = breakdown_by_context()
    first = next(iter(by_context))
    fig = Figure(figsize=(12.5, 4.6))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.2]})
    ops = sorted(by_context[first], key=lambda name: -by_context[first][name])
    ms = [by_context[first][name] * 1e3 for name in ops]
    left.barh(range(len(ops)), ms, color=[OP_COLORS.get(n, "gray") for n in ops])
    for y, value in enumerate(ms):
        left.text(value, y, f" {value:.2f} ms", va="center", fontsize=8)
    left.set_yticks(range(len(ops)), ops)
    left.invert_yaxis()
    left.set_xlim(0, max(ms) * 1.3)
    left.set(xlabel="ms per decode step (median of 5)",
             title=f"one step at {first} tokens of context: {sum(ms):.1f} ms")
    y = np.arange(len(by_context))
    lefts = np.zeros(len(by_context))
    for name in ops:
        widths = np.array([times.get(name, 0.0) for times in by_context.values()]) * 1e3
        right.barh(y, widths, left=lefts, color=OP_COLORS.get(name, "gray"), label=name)
        lefts += widths
    for yi, total in zip(y, lefts):
        right.text(total, yi, f" {total:.0f} ms", va="center", fontsize=8)
    right.set_yticks(y, [f"{c:,} tokens" for c in by_context])
    right.invert_yaxis()
    right.set_xlim(0, lefts.max() * 1.15)
    right.set(xlabel="ms per decode step", title="the same step with a longer context")
    right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=5, frameon=False)
    fig.suptitle(f"{model.cfg.num_hidden_layers}-layer {resolve_model('default').name}, NumPy float32 on the CPU "
                 f"(tinyvllm.model.op_timer.timed_ops); GPU numbers: see bench/results/decode-*.json", fontsize=10)
    fig.tight_layout()
    return fig


def weight_bytes(cfg, bytes_per_value: int) -> int:
    return bytes_per_value * sum(int(np.prod(s)) for s in expected_tensor_shapes(cfg).values())


def draw_kv_growth() -> Figure:
    """KV cache bytes against context length, from the configs (model/kv_pool.py's formula), next to the weights."""
    smol, llama = load_config(resolve_model("default")), PRESETS["llama-3.2-1b"]
    lines = [("SmolLM2-135M, f32 (the CPU engine)", smol, 4, "#55A868", "--"),
             ("SmolLM2-135M, bf16 (the GPU engine)", smol, 2, "#55A868", "-"),
             ("Llama 3.2 1B, bf16", llama, 2, "#4C72B0", "-")]
    fig = Figure(figsize=(9.5, 5.2))
    ax = fig.subplots()
    for name, cfg, width, color, style in lines:
        tokens = np.logspace(0, np.log2(cfg.max_position_embeddings), 200, base=2)
        per_token = checkpoint.kv_bytes_per_token(cfg, width)
        ax.loglog(tokens, tokens * per_token, style, color=color, label=f"{name}: {per_token / 1024:g} KiB per token")
    for name, cfg, width, color in [("SmolLM2-135M weights, bf16", smol, 2, "#55A868"),
                                    ("Llama 3.2 1B weights, bf16", llama, 2, "#4C72B0")]:
        w = weight_bytes(cfg, width)
        crossing = w / checkpoint.kv_bytes_per_token(cfg, width)
        ax.axhline(w, color=color, lw=0.8, ls=":")
        ax.text(1.3, w * 1.15, f"{name}: {w / 1e9:.2f} GB", color=color, fontsize=8)
        if crossing <= cfg.max_position_embeddings:
            ax.plot([crossing], [w], "o", color=color)
            ax.annotate(f"cache = weights at {crossing:,.0f} tokens", (crossing, w), xytext=(-170, 8),
                        textcoords="offset points", fontsize=8, color=color)
    ax.set(xlabel="tokens in the cache (one sequence; a batch multiplies it)", ylabel="bytes of K and V",
           title="the KV cache: 2 x layers x kv_heads x head_dim x bytes per token")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def attention_of_new_token(layers: list[int], prompt: str = PROMPT) -> tuple[list[str], dict[int, np.ndarray]]:
    """The step that picked the answer's last token: the new token's attention weights over the whole
    context, per layer, (heads, context) each, from the queries that step used and its cache's keys."""
    model, tok = engine()
    gen = answer(prompt)
    ids = gen.prompt_ids + gen.tokens[:-1]  # prompt + answer, without the stop token
    _, cache, queries = checkpoint.check_parity(model, ids, checkpoint.TOLERANCE["cpu"])
    H, d = model.cfg.num_attention_heads, model.cfg.head_dim
    weights = {}
    for layer in layers:
        k, _ = cache.view(0, layer)                              # (context, kv_heads, d), RoPE applied
        q = queries[layer][0]                                    # (H, d): the new token's query heads
        k_per_head = k[:, np.arange(H) // (H // k.shape[1])]     # GQA: query head h reads K/V head h // G
        scores = np.einsum("hd,thd->ht", q, k_per_head) / np.float32(np.sqrt(d))
        weights[layer] = reference.softmax(scores)
    return [label(tok, i) for i in ids], weights


def draw_attention_weights(prompt: str = PROMPT) -> Figure:
    """Heat maps of the new token's attention over prompt + answer, every head of a middle and the last layer."""
    model, tok = engine()
    layers = [model.cfg.num_hidden_layers // 2, model.cfg.num_hidden_layers - 1]
    labels, weights = attention_of_new_token(layers, prompt)
    gen = answer(prompt)
    prompt_len = len(gen.prompt_ids)
    fig = Figure(figsize=(13, 3.2 * len(layers) + 1))
    axes = fig.subplots(len(layers), 1)
    for ax, layer in zip(axes, layers):
        w = weights[layer]
        image = ax.imshow(w, cmap="magma_r", vmin=0, vmax=1, aspect="auto")
        ax.axvline(prompt_len - 0.5, color="#4C72B0", lw=1.5)
        ax.set_yticks(range(len(w)), [f"head {h}" for h in range(len(w))], fontsize=7)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        top = w.max(0).argsort()[::-1][:3]
        ax.set_title(f"layer {layer}: the largest weights fall on " + ", ".join(f"'{labels[t]}' ({t})" for t in top),
                     fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.02, pad=0.01)
    picked = label(tok, gen.tokens[-1])
    fig.suptitle(f"the newest token '{labels[-1]}' (position {len(labels) - 1}; its decode step picked '{picked}') "
                 "attending over the whole context: prompt left of the blue line, the answer so far right of it\n"
                 "(softmax of q . k / sqrt(d) with the query its decode step used and the keys in its cache; "
                 "each row sums to 1)", fontsize=10)
    fig.tight_layout()
    return fig


FIGURES = {
    "ch05_timeline.png": draw_timeline,
    "ch05_step_breakdown.png": draw_step_breakdown,
    "ch05_kv_growth.png": draw_kv_growth,
    "ch05_attention_weights.png": draw_attention_weights,
}
