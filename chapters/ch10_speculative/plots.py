"""Chapter 10's figures: the measured speed-up of prompt lookup (from bench/results), the arithmetic of when a
verification step stops being free (batch size), and the tokens each verification emitted in a run."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # no pyplot: the same code draws for files (Agg) and notebooks

from tinyvllm.formats.checkpoints import PRESETS
from tinyvllm.formats.config import expected_tensor_shapes

RESULTS = Path(__file__).resolve().parent.parent.parent / "bench" / "results"
# `python bench/spec_decode.py`: default model, batch 1, greedy, k = 4, 3 grounded and 3 free-form requests
MEASURED = {"CPU (2 cores)": "spec-decode-cpu-20261203-071701.json",
            "H200, verification as a prefill chunk": "spec-decode-cuda-20261203.json",
            "H200, verification as graphed decode rows": "spec-decode-cuda-20261203-142824.json"}
# the H200's copy bandwidth and bf16 GEMM rate, measured in one run of `python bench/prefill.py`
LIMITS = "prefill-20261129-224234.json"
WORKLOADS = ("grounded", "free-form")
COLORS = {"off": "#8C8C8C", "ngram": "#4C72B0"}


def measured() -> dict[str, dict]:
    """{machine: its bench/spec_decode.py results per workload}."""
    return {machine: json.loads((RESULTS / name).read_text())["results"] for machine, name in MEASURED.items()}


def measured_table() -> str:
    """The measured runs as the Markdown table of the chapter's text."""
    lines = ["| machine | workload | off, tokens/s | prompt lookup k = 4, tokens/s | speed-up | acceptance | tokens per "
             "verification | same tokens |", "|---|---|---|---|---|---|---|---|"]
    for machine, results in measured().items():
        for workload in WORKLOADS:
            r = results[workload]
            off, on = r["tokens_per_s"]["off"]["median"], r["tokens_per_s"]["ngram"]["median"]
            lines.append(f"| {machine} | {workload} | {off:.1f} | {on:.1f} | ×{r['speedup_median']:.2f} | "
                         f"{r['acceptance_rate']:.0%} | {r['mean_tokens_per_verification']:.2f} | "
                         f"{'yes' if r['same_tokens'] else 'no'} |")
    return "\n".join(lines)


def draw_measured() -> Figure:
    """Tokens per second with speculation off and on, per machine and workload (medians of the runs)."""
    fig = Figure(figsize=(4.5 * len(MEASURED), 3.6))
    axes = fig.subplots(1, len(MEASURED))
    for ax, (machine, results) in zip(axes, measured().items()):
        x = np.arange(len(WORKLOADS))
        for shift, mode, label in ((-0.2, "off", "plain decode"), (0.2, "ngram", "prompt lookup, k = 4")):
            rates = [results[w]["tokens_per_s"][mode]["median"] for w in WORKLOADS]
            ax.bar(x + shift, rates, 0.38, color=COLORS[mode], label=label)
        for i, w in enumerate(WORKLOADS):
            r = results[w]
            top = max(r["tokens_per_s"]["off"]["median"], r["tokens_per_s"]["ngram"]["median"])
            ax.text(i, top * 1.03, f"×{r['speedup_median']:.2f}\n{r['mean_tokens_per_verification']:.2f} tok/verif.",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, WORKLOADS)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
        ax.set_title(f"{machine}, batch 1", fontsize=9)
        ax.set_ylabel("output tokens/s (median)")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("Measured: bench/results/" + " and ".join(MEASURED.values()), fontsize=8)
    fig.tight_layout()
    return fig


# ---- the arithmetic of section 6: a model with measured parameters, not a measurement ----

def limits() -> tuple[float, float]:
    """(bytes/s, FLOP/s): the H200's copy bandwidth and bf16 GEMM rate, measured by bench/prefill.py."""
    run = json.loads((RESULTS / LIMITS).read_text())
    return run["copy_bandwidth_gb_s"] * 1e9, run["bf16_gemm_tflops_measured"] * 1e12


def llama_params() -> float:
    """Llama 3.2 1B's weights (1,235.8 M; the tied head is the embedding, read once a step as the head)."""
    return float(sum(np.prod(shape) for shape in expected_tensor_shapes(PRESETS["llama-3.2-1b"]).values()))


def step_seconds(tokens: int, params: float, bandwidth: float, flops: float) -> float:
    """A step's weight traffic or its GEMM work, whichever takes longer (the roofline; attention and the KV
    cache left out): reading 2 bytes per bf16 weight once, 2 FLOP per weight per token."""
    return max(2 * params / bandwidth, 2 * params * tokens / flops)


def spec_speedup(batch: int, k: int, tokens_per_verification: float, params: float, bandwidth: float,
                 flops: float) -> float:
    """Tokens per second with speculation over without, when every sequence verifies k guesses a step."""
    plain = batch / step_seconds(batch, params, bandwidth, flops)
    spec = batch * tokens_per_verification / step_seconds(batch * (k + 1), params, bandwidth, flops)
    return spec / plain


def draw_when_speculation_pays(k: int = 4) -> Figure:
    bandwidth, flops = limits()
    params = llama_params()
    batches = np.unique(np.geomspace(1, 1024, 60).astype(int))
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    for per in (2.0, 3.44, k + 1.0):
        label = {k + 1.0: f"every guess kept ({k + 1:.0f} tokens)",
                 3.44: "3.44 tokens per verification (grounded, measured)"}.get(per, f"{per:.0f} tokens per verification")
        ax.plot(batches, [spec_speedup(b, k, per, params, bandwidth, flops) for b in batches], label=label)
    ridge = flops / bandwidth   # tokens a step at which the GEMMs take as long as reading the weights
    ax.axvline(ridge / (k + 1), color="#C44E52", ls=":", lw=1)
    ax.text(ridge / (k + 1) * 2.5, 4.6, f"right of batch {ridge / (k + 1):.0f}: a verification step\nholds {k + 1} x "
            f"batch > {ridge:.0f} tokens and turns\ncompute-bound: its extra tokens cost time", fontsize=8, va="top",
            color="#C44E52")
    ax.axhline(1, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("batch (sequences decoding at once)")
    ax.set_ylabel("speed-up from speculation")
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(f"Arithmetic, not a measurement: Llama 3.2 1B in bf16, k = {k}, the roofline of\n"
                 f"{bandwidth / 1e12:.2f} TB/s and {flops / 1e12:.0f} TFLOP/s measured on an H200 "
                 f"(bench/results/{LIMITS})", fontsize=9)
    fig.tight_layout()
    return fig


def draw_tokens_per_verification(runs: dict) -> Figure:
    """How many tokens each verification emitted (1 to k + 1), per prompt: checkpoint.run's Run.emitted."""
    fig = Figure(figsize=(7, 3.2))
    ax = fig.subplots()
    most = max((n for r in runs.values() for n in r.emitted), default=1)
    x = np.arange(1, most + 1)
    width = 0.8 / max(len(runs), 1)
    for i, (name, r) in enumerate(runs.items()):
        counts: Counter = r.emitted
        total = max(sum(counts.values()), 1)
        ax.bar(x + (i - (len(runs) - 1) / 2) * width, [counts.get(n, 0) / total for n in x], width,
               label=f"{name}: {sum(counts.values())} verifications, {r.steps} steps for {len(r.tokens)} tokens")
    ax.set_xticks(x)
    ax.set_xlabel("tokens emitted by one verification (kept guesses + the model's own token)")
    ax.set_ylabel("share of verifications")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def draw_rejection_check(p: np.ndarray, q: np.ndarray, rules: dict, draws: int = 20_000, seed: int = 10) -> Figure:
    """The target p, the draft q, and the frequencies of the tokens each rule emitted over `draws` positions
    (speculative.draw_many), with each rule's chi-square p-value against p in the legend."""
    from chapters.ch10_speculative.speculative import chi_square_p_value, draw_many
    fig = Figure(figsize=(8, 3.4))
    ax = fig.subplots()
    x = np.arange(len(p))
    bars = 2 + len(rules)
    width = 0.85 / bars
    ax.bar(x - 0.425 + width / 2, p, width, color="black", label="target p")
    ax.bar(x - 0.425 + 1.5 * width, q, width, color="#BBBBBB", label="draft q")
    for i, (name, rule) in enumerate(rules.items()):
        counts, kept = draw_many(rule, p, q, draws, seed)
        ax.bar(x - 0.425 + (2.5 + i) * width, counts / draws, width,
               label=f"{name}: chi-square p = {chi_square_p_value(counts, p):.2g}, kept {kept / draws:.0%}")
    ax.set_xticks(x)
    ax.set_xlabel("token")
    ax.set_ylabel("probability / frequency")
    ax.set_title(f"{draws:,} positions: the emitted tokens against p (sum(min(p, q)) = {np.minimum(p, q).sum():.0%})",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


FIGURES = {
    "ch10_measured.png": draw_measured,
    "ch10_when_speculation_pays.png": draw_when_speculation_pays,
}
