"""Chapter 9 figures and arithmetic (`make figures`; the notebook calls the same functions): which rank holds
which element of every weight, drawn from the engine's own shard_weight, and when splitting a decode step
over N GPUs pays, from the models' configs and two bandwidths given as parameters."""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure  # no pyplot: the same code draws for files (Agg) and notebooks
from matplotlib.patches import Rectangle

from tinyvllm.formats.checkpoints import PRESETS
from tinyvllm.formats.config import LlamaConfig
from tinyvllm.model import tensor_parallel

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
EVERY_RANK = "#BBBBBB"
# a toy layer small enough to draw element by element: 4 heads, 2 K/V heads of 2, hidden 8, vocabulary 12
TOY = LlamaConfig(vocab_size=12, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=2)

# ---- the arithmetic of section 5: parameters, not measurements ----
HBM_GBPS = 4230   # memory bandwidth per GPU: the H200 copy bandwidth measured in this course's runs (README)
LINK_GBPS = 450   # GPU-to-GPU bandwidth, each way: NVLink 4's 900 GB/s per GPU counts both directions
MODELS = {"Llama 3.2 1B": PRESETS["llama-3.2-1b"], "Llama 3.1 8B": PRESETS["llama-3.1-8b"]}


def owners(name: str, shape: tuple[int, ...], cfg: LlamaConfig, world: int) -> np.ndarray:
    """Which rank holds each element of a weight (-1: every rank), found by sharding the weight's own
    element numbers with the engine's shard_weight."""
    numbers = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    count, owner = np.zeros(numbers.size, int), np.zeros(numbers.size, int)
    for rank in range(world):
        held = tensor_parallel.shard_weight(name, numbers, cfg, rank, world).astype(np.int64).ravel()
        count[held] += 1
        owner[held] = rank
    return np.where(count == world, -1, owner).reshape(shape) if world > 1 else owner.reshape(shape)


def draw_matrix(ax, x: float, owner: np.ndarray, title: str, note: str, cuts: tuple[int, ...] = ()) -> None:
    """A weight as a grid of cells, (out, in) = (rows, columns), top-left at (x, 0); `cuts`: rows where a
    fused matrix's parts meet."""
    grid = owner.reshape(owner.shape[0], -1)
    for (i, j), rank in np.ndenumerate(grid):
        color = EVERY_RANK if rank < 0 else RANK_COLORS[rank]
        ax.add_patch(Rectangle((x + j, -i - 1), 1, 1, facecolor=color, edgecolor="white", lw=0.6))
    for row in cuts:
        ax.plot([x - 0.3, x + grid.shape[1] + 0.3], [-row, -row], color="black", lw=1.6)
    ax.text(x + grid.shape[1] / 2, 1.0, title, ha="center", va="bottom", fontsize=10, weight="bold")
    ax.text(x + grid.shape[1] / 2, -grid.shape[0] - 0.8, note, ha="center", va="top", fontsize=8)


def draw_shards(world: int = 2, cfg: LlamaConfig = TOY) -> Figure:
    """Every kind of weight of a toy layer, each element coloured by the rank that holds it."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    weights = [  # (engine name, shape, title, note, rows where fused parts meet)
        ("embed", (cfg.vocab_size, h), "embed (vocab, hidden)", "vocabulary rows\nlook up, zeros elsewhere\n→ all-reduce", ()),
        ("0.qkv", (q + 2 * kv, h), "qkv", "column-parallel:\nits Q, K, V heads\n(rows of each part)", (q, q + kv)),
        ("0.o_proj", (h, q), "o_proj", "row-parallel:\nits heads' input columns\n→ all-reduce", ()),
        ("0.gate_up", (2 * inter, h), "gate_up", "column-parallel:\nits gate rows and\nthe same up rows", (inter,)),
        ("0.down", (h, inter), "down", "row-parallel:\nits intermediate columns\n→ all-reduce", ()),
        ("lm_head", (cfg.vocab_size, h), "lm_head", "vocabulary rows\nits logits' slice\n→ gathered", ()),
        ("0.input_norm", (1, h), "norms", "replicated:\nevery rank", ()),
    ]
    fig = Figure(figsize=(15, 5.2))
    ax = fig.subplots()
    x = 0.0
    for name, shape, title, note, cuts in weights:
        owner = owners(name, shape if shape[0] > 1 else shape[1:], cfg, world).reshape(shape)
        draw_matrix(ax, x, owner, title, note, cuts)
        x += shape[1] + 4
    for i, color in enumerate(RANK_COLORS[:world] + [EVERY_RANK]):
        label = f"rank {i}" if i < world else "every rank"
        ax.add_patch(Rectangle((i * 9, -22.5), 1, 1, facecolor=color))
        ax.text(i * 9 + 1.5, -22, label, va="center", fontsize=9)
    ax.text(x - 4, -22, "Q | K | V and gate | up: the black lines", ha="right", va="center", fontsize=9)
    ax.set(xlim=(-1, x - 3), ylim=(-24, 3), aspect="equal")
    ax.axis("off")
    ax.set_title(f"A toy layer over {world} ranks ({cfg.num_attention_heads} heads, {cfg.num_key_value_heads} K/V heads "
                 f"of {cfg.head_dim}, hidden {h}, intermediate {inter}, vocabulary {cfg.vocab_size}); weights "
                 "stored (out, in): rows are outputs", fontsize=10)
    return fig


def decode_weight_bytes(cfg: LlamaConfig, itemsize: int = 2) -> int:
    """The weight bytes one decode step reads: every layer's matrices and norms, the final norm, and ONE
    vocabulary x hidden table (the LM head; the embedding is read a row per token)."""
    h = cfg.hidden_size
    layer = (cfg.q_size + 2 * cfg.kv_size) * h + h * cfg.q_size + 3 * cfg.intermediate_size * h + 2 * h
    return itemsize * (cfg.num_hidden_layers * layer + h + cfg.vocab_size * h)


def all_reduces_per_step(cfg: LlamaConfig) -> int:
    """After the embedding, then after o_proj and after down in every layer."""
    return 1 + 2 * cfg.num_hidden_layers


def decode_step_ms(cfg: LlamaConfig, world: int, latency_us: float, batch: int = 1, hbm_gbps: float = HBM_GBPS,
                   link_gbps: float = LINK_GBPS) -> tuple[float, float]:
    """(weights, communication) in ms for one decode step on `world` GPUs, at the bandwidth floors.

    Weights: each GPU reads its 1/world of them. Communication: every all-reduce costs `latency_us` plus
    its bytes over the link (a ring all-reduce sends 2 (N - 1) / N of the batch x hidden bf16 values from
    each GPU), and the logits, (N - 1) / N of batch x vocab in fp32, are gathered on one GPU."""
    weights_ms = decode_weight_bytes(cfg) / world / (hbm_gbps * 1e6)
    if world == 1:
        return weights_ms, 0.0
    ring_bytes = 2 * (world - 1) / world * batch * cfg.hidden_size * 2
    gather_bytes = (world - 1) / world * batch * cfg.vocab_size * 4
    comm_us = all_reduces_per_step(cfg) * (latency_us + ring_bytes / (link_gbps * 1e3)) + \
        latency_us + gather_bytes / (link_gbps * 1e3)
    return weights_ms, comm_us / 1e3


def break_even_latency_us(cfg: LlamaConfig, world: int, batch: int = 1, **bandwidths) -> float:
    """The latency per collective at which `world` GPUs decode exactly as fast as one."""
    one, _ = decode_step_ms(cfg, 1, 0.0, batch, **bandwidths)
    weights, bytes_only = decode_step_ms(cfg, world, 0.0, batch, **bandwidths)
    return (one - weights - bytes_only) * 1e3 / (all_reduces_per_step(cfg) + 1)


def tp_table(worlds=(2, 4, 8), batch: int = 1, **bandwidths) -> list[dict]:
    """For each model and world size: what each GPU reads, what it saves, what it sends, the break-even latency."""
    rows = []
    for model, cfg in MODELS.items():
        one, _ = decode_step_ms(cfg, 1, 0.0, batch, **bandwidths)
        for world in worlds:
            weights, bytes_only = decode_step_ms(cfg, world, 0.0, batch, **bandwidths)
            rows.append({"model": model, "N": world, "weights per GPU (GB)": decode_weight_bytes(cfg) / world / 1e9,
                         "saved (ms)": one - weights, "all-reduces": all_reduces_per_step(cfg),
                         "bytes per all-reduce per token": cfg.hidden_size * 2, "link time (µs)": bytes_only * 1e3,
                         "break-even latency (µs)": break_even_latency_us(cfg, world, batch, **bandwidths)})
    return rows


def draw_when_tp_pays(batch: int = 1, hbm_gbps: float = HBM_GBPS, link_gbps: float = LINK_GBPS) -> Figure:
    """Decode step time at the floors against the cost of one collective, for 1, 2, 4 and 8 GPUs."""
    latencies = np.linspace(0, 40, 81)
    fig = Figure(figsize=(13, 4.6))
    for ax, (model, cfg) in zip(fig.subplots(1, 2), MODELS.items()):
        for world, color in zip((1, 2, 4, 8), ["black", *RANK_COLORS[:3]]):
            total = [sum(decode_step_ms(cfg, world, a, batch, hbm_gbps, link_gbps)) for a in latencies]
            ax.plot(latencies, total, color=color, lw=2, label=f"{world} GPU{'s' if world > 1 else ''}")
        even = break_even_latency_us(cfg, 2, batch, hbm_gbps=hbm_gbps, link_gbps=link_gbps)
        ax.axvline(even, color=RANK_COLORS[0], ls=":", lw=1)
        ax.text(even + 0.5, ax.get_ylim()[1] * 0.95, f"2 GPUs stop paying\nat {even:.1f} µs", fontsize=8, va="top")
        ax.set(xlabel="cost of one all-reduce (µs): to be measured with NCCL", ylabel="ms per decode step",
               title=f"{model}: {decode_weight_bytes(cfg) / 1e9:.2f} GB of weights per step, "
                     f"{all_reduces_per_step(cfg)} all-reduces + 1 gather", ylim=(0, None))
        ax.title.set_fontsize(10)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Arithmetic, not a measurement: batch {batch}, each GPU reading at {hbm_gbps:,} GB/s, "
                 f"links at {link_gbps} GB/s each way", fontsize=10)
    return fig


FIGURES = {
    "ch09_shards.png": draw_shards,
    "ch09_when_tp_pays.png": draw_when_tp_pays,
}
