"""Chapter 3 figures, from the real default model on the chapter's prompt (`make figures`; the notebook
calls the same functions), and from the newest prefill benchmark if bench/results holds one."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # no pyplot: the same code draws for files (Agg) and notebooks

from chapters.ch01_map import checkpoint as ch01
from chapters.ch03_prefill import checkpoint
from tinyvllm import reference
from tinyvllm.formats import bf16

HEATMAP_LAYER = 16  # a layer where one K/V group holds a previous-token head next to two sink heads
BENCH_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@lru_cache(maxsize=1)
def prompt_run() -> tuple[ch01.Loaded, list[int], checkpoint.ReferenceRun]:
    """The reference model, the chapter's prompt as ids, and its forward pass with every layer kept."""
    m = ch01.load()
    ids = m.tok.apply_chat_template(checkpoint.MESSAGES)
    return m, ids, checkpoint.reference_layers(m.model, ids)


def head_probabilities(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Causal attention probabilities of every query head, (H, T, T), with GQA's head -> K/V head map."""
    T, H, d = q.shape
    k_per_head = k[:, np.arange(H) // (H // k.shape[1])]                     # (T, H, d)
    scores = np.einsum("thd,shd->hts", q, k_per_head) / np.float32(np.sqrt(d))
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    return reference.softmax(np.where(future, np.float32(-np.inf), scores))


def token_labels(m: ch01.Loaded, ids: list[int]) -> list[str]:
    return [m.tok.decode([i]).replace("\n", "\\n") for i in ids]


def draw_attention_heads(layer: int = HEATMAP_LAYER) -> Figure:
    """All query heads of one layer on the chapter's prompt; each row of panels shares one K/V head."""
    m, ids, run = prompt_run()
    q, k, _ = run.qkv[layer]
    probs = head_probabilities(q, k)
    H, group, labels = probs.shape[0], probs.shape[0] // k.shape[1], token_labels(m, ids)
    cols = group
    rows = H // cols
    fig = Figure(figsize=(4.4 * cols, 4.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for h, ax in enumerate(axes.flat):
        p = probs[h]
        ax.imshow(p, cmap="magma_r", vmin=0, vmax=1)
        ax.set_title(f"head {h} (K/V head {h // group}): previous {np.mean(np.diagonal(p, -1)):.2f}, "
                     f"first {p[1:, 0].mean():.2f}", fontsize=8.5)
        ticks = range(0, len(ids), 3)
        ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=90, fontsize=6)
        ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=6)
    fig.suptitle(f"layer {layer} (counting from 0) of {m.model_dir.name} on {checkpoint.PROMPT!r} ({len(ids)} tokens): "
                 f"attention probabilities per head\n(rows: queries, columns: keys; mean weight on the previous "
                 f"token and on the first token; above the diagonal = future, 0)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def bf16_round(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bf16 value, kept in float32."""
    return bf16.bf16_bits_to_float32(bf16.float32_to_bf16_bits(x))


def draw_residual_norm() -> Figure:
    """Left: the residual stream's size after each layer. Right: what storing it in bf16 would cost."""
    m, ids, run = prompt_run()
    low = checkpoint.reference_layers(m.model, ids, round_stream=bf16_round)
    layers = np.arange(len(run.stream))  # 0 = the embedding, n = after n layers
    norms = np.array([np.linalg.norm(x, axis=1) for x in run.stream])  # (layers + 1, T)
    fig = Figure(figsize=(12.5, 4.6))
    left, right = fig.subplots(1, 2)
    first = token_labels(m, ids)[0]
    left.semilogy(layers, norms[:, 0], "o-", ms=3, label=f"token 0 ({first})")
    left.semilogy(layers, np.median(norms[:, 1:], axis=1), "s-", ms=3, label="median of the other tokens")
    left.semilogy(layers, norms[:, -1], "^-", ms=3, label="the last token (its logits pick the answer)")
    left.set(xlabel="layers applied (0 = the embedding alone)", ylabel="‖x‖ of the token's residual row",
             title="the residual stream's size, layer after layer")
    left.legend(fontsize=8)
    # tokens 1.. only: token 0's huge row would dominate every norm
    stream_err = [checkpoint.rel_err(a[1:], b[1:]) for a, b in zip(low.stream[1:], run.stream[1:])]
    once_err = [checkpoint.rel_err(bf16_round(x[1:]), x[1:]) for x in run.stream[1:]]
    right.semilogy(layers[1:], stream_err, "o-", ms=3, label="stored in bf16: rounded after every addition")
    right.semilogy(layers[1:], once_err, "s--", ms=3, label="one bf16 rounding of the exact stream")
    right.set(xlabel="layers applied", ylabel="relative error vs the float32 stream (tokens 1..)",
              title="a bf16 residual stream: the rounding errors add up")
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def latest_bench_result(results_dir: Path = BENCH_RESULTS) -> Path | None:
    """The newest bench/results/prefill-*.json (the names sort by time) that timed several prompt lengths (a run
    with --lengths 4096 alone makes a poor figure), or None."""
    found = [p for p in sorted(results_dir.glob("prefill-*.json")) if len(json.loads(p.read_text())["results"]) > 1]
    return found[-1] if found else None


def draw_prefill_time(path: Path | None = None) -> Figure:
    """Where a GPU prefill's time goes, per prompt length, from a `python bench/prefill.py` result."""
    path = path or latest_bench_result()
    result = json.loads(path.read_text())
    rows = result["results"]
    names = sorted({k for r in rows for k in r["kernel_seconds"]},
                   key=lambda k: -sum(r["kernel_seconds"].get(k, 0) for r in rows))
    fig = Figure(figsize=(12.5, 4.6))
    left, right = fig.subplots(1, 2)
    y = np.arange(len(rows))
    starts = np.zeros(len(rows))
    for name in names + ["host_and_gaps"]:
        share = np.array([(r["kernel_seconds"].get(name, 0) if name != "host_and_gaps" else
                           max(r["host_and_gaps_seconds"], 0)) / r["seconds"] for r in rows])
        left.barh(y, share, left=starts, label=name.replace("_", " "))
        starts += share
    left.set_yticks(y, [f"T = {r['tokens']}" for r in rows])
    left.set(xlabel="fraction of the prefill's time", title="where the time goes")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)
    width = 0.38
    right.bar(y - width / 2, [r["seconds"] * 1e3 for r in rows], width, label="tinyvllm")
    if all("hf_seconds" in r for r in rows):
        right.bar(y + width / 2, [r["hf_seconds"] * 1e3 for r in rows], width, label="transformers (bf16)")
    right.set_xticks(y, [str(r["tokens"]) for r in rows])
    right.set_yscale("log")
    right.set(xlabel="prompt tokens", ylabel="ms (log scale)",
              title=f"prefill time, {result['machine']['gpu']}")
    right.legend(fontsize=8)
    fig.suptitle(f"{path.name}: measured bf16 GEMM rate {result['bf16_gemm_tflops_measured']:.0f} TFLOP/s",
                 fontsize=10)
    fig.tight_layout()
    return fig


FIGURES = {
    "ch03_attention_heads.png": draw_attention_heads,
    "ch03_residual_norm.png": draw_residual_norm,
}
if latest_bench_result():  # drawn only once a GPU benchmark has been recorded
    FIGURES["ch03_prefill_time.png"] = draw_prefill_time
