"""Chapter 6 figures: the checkpoint's workload run on the CPU with the default model (`make figures`; the
notebook calls the same functions), and the memory a max-length cache wastes, from the models' configs."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from matplotlib.figure import Figure  # no pyplot: the same code draws for files (Agg) and notebooks
from matplotlib.patches import FancyArrowPatch, Rectangle

from chapters.ch06_paged_kv import checkpoint
from tinyvllm.engine.block_manager import BLOCK_SIZE, blocks_for
from tinyvllm.formats.checkpoints import PRESETS, resolve_model
from tinyvllm.formats.config import LlamaConfig, load_config
from tinyvllm.formats.tokenizer import load_tokenizer
from tinyvllm.model.kv_pool import bytes_per_block
from tinyvllm.model.model import Model

SEQ_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
FREE_COLOR = "#F2F2F2"


@lru_cache(maxsize=1)
def workload() -> checkpoint.Run:
    """The checkpoint's five prompts, prefilled into one pool of checkpoint.NUM_BLOCKS blocks and decoded
    together on the CPU (greedy, sequence 1 cancelled after step 8), every step's block tables kept."""
    model_dir = resolve_model("default")
    model, tok = Model(model_dir, "cpu", max_num_batched_tokens=checkpoint.MAX_TOKENS), load_tokenizer(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in checkpoint.PROMPTS]
    return checkpoint.run_together(model, tok, prompts)


def reuse_step(run: checkpoint.Run) -> int:
    """The last step at which some sequence holds a block that another sequence held before it."""
    return max((snap.step for i, snap in enumerate(run.snapshots) if reused_blocks(run, i)), default=0)


def reused_blocks(run: checkpoint.Run, step: int) -> set[int]:
    """The blocks that, at this step, belong to a sequence other than one that held them before."""
    held = checkpoint.holders(run.snapshots[:step + 1])
    return {b for seq, table in run.snapshots[step].tables.items() for b in table if held[b] - {seq}}


def owners_and_fill(snap: checkpoint.Snapshot, num_blocks: int) -> tuple[list[int], list[int]]:
    """Per physical block: the sequence that owns it (-1 if free) and how many of its 16 slots hold a token."""
    owner, fill = [-1] * num_blocks, [0] * num_blocks
    for seq, table in snap.tables.items():
        for i, block in enumerate(table):
            owner[block] = seq
            fill[block] = min(BLOCK_SIZE, snap.lengths[seq] - i * BLOCK_SIZE)
    return owner, fill


def draw_block(ax, x: float, y: float, owner: int, fill: int, label: str, reused: bool = False,
               faded: bool = False) -> None:
    """One block as a unit square at (x, y): its owner's colour, filled from the bottom as far as its tokens go;
    a thick border if it was another sequence's before."""
    ax.add_patch(Rectangle((x, y), 0.9, 0.9, facecolor=FREE_COLOR, edgecolor="#999999", lw=0.6))
    if owner >= 0:
        ax.add_patch(Rectangle((x, y), 0.9, 0.9 * fill / BLOCK_SIZE, facecolor=SEQ_COLORS[owner % len(SEQ_COLORS)],
                               alpha=0.25 if faded else 0.9, lw=0))
    if reused:
        ax.add_patch(Rectangle((x, y), 0.9, 0.9, fill=False, edgecolor="black", lw=2.4))
    white = owner >= 0 and not faded and fill >= 12  # on the colour, not on the empty part
    ax.text(x + 0.45, y + 0.45, label, ha="center", va="center", fontsize=7, color="white" if white else "black")


def draw_pool_grid() -> Figure:
    """The physical pool at four moments of the workload: each block coloured by the sequence that owns it,
    filled as far as its tokens go; a thick border: the block was another sequence's earlier (a reused hole)."""
    run = workload()
    n, last = run.num_blocks, reuse_step(run)
    cancel_step = next(s.step for s in run.snapshots if "cancelled" in s.event)
    finish_step = next(s.step for s in run.snapshots if "finished" in s.event and s.step != cancel_step)
    moments = [(0, "after the five prefills"), (cancel_step, run.snapshots[cancel_step].event),
               (finish_step, run.snapshots[finish_step].event), (last, "freed blocks reused")]
    fig = Figure(figsize=(13, 0.5 * len(moments) + 1.3))
    ax = fig.subplots()
    rows = {step: row for row, (step, _) in enumerate(moments)}
    for step, row in rows.items():
        snap, y = run.snapshots[step], -1.3 * row
        owner, fill = owners_and_fill(snap, n)
        reused = reused_blocks(run, step)
        for block in range(n):
            o = owner[block]
            draw_block(ax, block, y, o, fill[block], f"s{o}" if o >= 0 else "", block in reused)
        used, tokens = sum(o >= 0 for o in owner), sum(snap.lengths.values())
        ax.text(-0.3, y + 0.45, f"step {step}: {dict(moments)[step]}\n{used} blocks used, "
                f"{tokens} tokens, {used * BLOCK_SIZE - tokens} empty slots", ha="right", va="center", fontsize=8)
    for block in range(n):
        ax.text(block + 0.45, 1.05, str(block), ha="center", va="bottom", fontsize=7, color="#555555")
    ax.text(n / 2, 1.5, "physical block id", ha="center", fontsize=8, color="#555555")
    ax.set_xlim(-7.5, n + 0.2)
    ax.set_ylim(-1.3 * (len(moments) - 1) - 0.3, 1.9)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.suptitle(f"the KV cache pool: {n} blocks of {BLOCK_SIZE} token slots shared by 5 sequences "
                 f"(s0..s4), filled from the bottom as far as their tokens go;\nthick border: a block another sequence "
                 f"held before (freed by the cancel or a finished answer, then taken by a growing one)", fontsize=10)
    fig.tight_layout()
    return fig


def draw_block_tables() -> Figure:
    """Each running sequence's block table at the step where freed blocks are reused: arrows from its
    logical blocks (bottom row) to the physical blocks of the pool (top row) that hold them."""
    run = workload()
    n, step = run.num_blocks, reuse_step(run)
    snap = run.snapshots[step]
    owner, fill = owners_and_fill(snap, n)
    reused = reused_blocks(run, step)
    seqs = sorted(snap.tables)
    fig = Figure(figsize=(13, 1.45 * len(seqs) + 0.5))
    axes = fig.subplots(len(seqs), 1, squeeze=False)[:, 0]
    for ax, seq in zip(axes, seqs):
        table = snap.tables[seq]
        for block in range(n):
            draw_block(ax, block, 2.2, owner[block], fill[block], str(block), block in reused,
                       faded=owner[block] != seq)
        for i, block in enumerate(table):
            tokens = min(BLOCK_SIZE, snap.lengths[seq] - i * BLOCK_SIZE)
            draw_block(ax, i, 0, seq, tokens, f"{i}")
            ax.add_patch(FancyArrowPatch((i + 0.45, 0.92), (block + 0.45, 2.18), arrowstyle="-|>", mutation_scale=8,
                                         color=SEQ_COLORS[seq % len(SEQ_COLORS)], lw=0.9, alpha=0.8))
        last = snap.lengths[seq] - (len(table) - 1) * BLOCK_SIZE
        ax.text(-0.3, 0.45, f"seq {seq}: {snap.lengths[seq]} tokens\nlogical blocks", ha="right", va="center",
                fontsize=8)
        ax.text(-0.3, 2.65, "pool", ha="right", va="center", fontsize=8)
        ax.text(len(table) + 0.2, 0.45, f"table {table}\nlast block holds {last} of {BLOCK_SIZE}: token t is in slot "
                f"table[t // 16] * 16 + t % 16", va="center", fontsize=8)
        ax.set_xlim(-5.5, n + 0.2)
        ax.set_ylim(-0.2, 3.2)
        ax.set_aspect("equal")
        ax.axis("off")
    layers = load_config(resolve_model("default")).num_hidden_layers
    fig.suptitle(f"block tables at step {step} of the workload: one table per sequence, shared by all {layers} "
                 "layers (thick border: a block freed by another sequence, then reused)", fontsize=10)
    fig.tight_layout()
    return fig


def draw_occupancy() -> Figure:
    """Blocks in use at every step of the workload, per sequence, against the pool's size and the fewest
    blocks the tokens could fit in."""
    run = workload()
    steps = [s.step for s in run.snapshots]
    fig = Figure(figsize=(11, 4.8))
    ax = fig.subplots()
    bottom = np.zeros(len(steps))
    for seq in range(len(run.prompts)):
        blocks = np.array([len(s.tables.get(seq, [])) for s in run.snapshots])
        ax.bar(steps, blocks, bottom=bottom, width=0.85, color=SEQ_COLORS[seq % len(SEQ_COLORS)],
               label=f"seq {seq} ({len(run.prompts[seq])}-token prompt, {run.ended[seq]})")
        bottom += blocks
    tokens = np.array([sum(s.lengths.values()) for s in run.snapshots])
    ax.step(steps, tokens / BLOCK_SIZE, where="mid", color="black", lw=1.2,
            label="tokens cached / 16 (no waste at all)")
    ax.axhline(run.num_blocks, color="#C44E52", ls="--", lw=1)
    ax.text(-0.5, run.num_blocks + 0.3, f"the pool: {run.num_blocks} blocks", va="bottom", fontsize=8, color="#C44E52")
    for s in run.snapshots:
        if s.event:
            used = sum(len(t) for t in s.tables.values())
            ax.annotate(s.event.replace(", ", "\n"), (s.step, used), xytext=(0, 40 if s.tables else 60),
                        textcoords="offset points", ha="center", fontsize=7, arrowprops={"arrowstyle": "->", "lw": 0.6})
    ax.set(xlabel="decode step (0: after the prefills)", ylabel="blocks in use",
           ylim=(0, run.num_blocks * 1.3), xlim=(-0.7, steps[-1] + 1.5))
    ax.set_title("the pool's occupancy during the checkpoint's workload: a sequence takes a block every 16 tokens "
                 "and gives all of them back when it ends", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)
    fig.tight_layout()
    return fig


def request_lengths(n: int, max_len: int, seed: int = 0) -> np.ndarray:
    """n requests' prompt + output tokens, a made-up but plausible mix: lognormal prompts (median 400)
    and answers (median 250), clipped to the context window."""
    rng = np.random.default_rng(seed)
    prompt = rng.lognormal(np.log(400), 1.0, n)
    output = rng.lognormal(np.log(250), 0.8, n)
    return np.clip(np.round(prompt + output), 1, max_len).astype(np.int64)


def kv_bytes(cfg: LlamaConfig, lengths: np.ndarray) -> dict[str, int]:
    """bf16 K/V bytes for these requests: the tokens themselves, paged (whole blocks of 16), and contiguous
    (every request reserves the model's whole context window, max_position_embeddings tokens)."""
    per_block = bytes_per_block(cfg, 2)
    per_token = per_block // BLOCK_SIZE
    return {"tokens cached": int(lengths.sum()) * per_token,
            "paged: whole blocks of 16": sum(blocks_for(int(n)) for n in lengths) * per_block,
            "contiguous: max_model_len each": len(lengths) * cfg.max_position_embeddings * per_token}


def waste_models() -> list[tuple[str, LlamaConfig]]:
    return [("SmolLM2-135M", load_config(resolve_model("default"))), ("Llama 3.2 1B", PRESETS["llama-3.2-1b"])]


def waste_table(num_requests: int = 256) -> dict[str, dict[str, int]]:
    """{model: {kind: bytes}} for num_requests requests of request_lengths(), clipped to the smaller window."""
    models = waste_models()
    lengths = request_lengths(num_requests, min(cfg.max_position_embeddings for _, cfg in models))
    return {name: kv_bytes(cfg, lengths) for name, cfg in models}


def draw_waste(num_requests: int = 256) -> Figure:
    """Left: the request lengths. Right: K/V bytes for them in bf16, paged vs a max-length contiguous cache."""
    models = waste_models()
    lengths = request_lengths(num_requests, min(cfg.max_position_embeddings for _, cfg in models))
    fig = Figure(figsize=(13, 4.8))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.4]})
    left.hist(lengths, bins=np.logspace(np.log10(50), np.log10(8192), 36), color="#4C72B0")
    left.set_xscale("log")
    left.axvline(np.median(lengths), color="black", lw=1)
    left.text(np.median(lengths) * 1.1, left.get_ylim()[1] * 0.92, f"median {np.median(lengths):.0f}", fontsize=8)
    left.set(xlabel="prompt + output tokens per request", ylabel="requests",
             title=f"{num_requests} requests: lognormal prompts (median 400) + answers (median 250)", )
    left.title.set_fontsize(10)
    table, colors, width = waste_table(num_requests), ["#55A868", "#4C72B0", "#C44E52"], 0.26
    for m, (name, cfg) in enumerate(models):
        for k, (kind, nbytes) in enumerate(table[name].items()):
            x = m + (k - 1) * width
            right.bar(x, nbytes / 2**30, width, color=colors[k], label=kind if m == 0 else None)
            right.text(x, nbytes / 2**30 * 1.15, f"{nbytes / 2**30:,.2f} GiB\n"
                       f"({nbytes / table[name]['tokens cached']:.3g}x)", ha="center", fontsize=7)
    right.set_xticks(range(len(models)), [f"{name}\nmax_model_len {cfg.max_position_embeddings:,}, "
                                          f"{bytes_per_block(cfg, 2) / BLOCK_SIZE / 1024:g} KiB per token"
                                          for name, cfg in models])
    right.set_yscale("log")
    right.set_ylim(top=right.get_ylim()[1] * 8)
    right.set_ylabel("GiB of K and V (bf16), log scale")
    right.set_title("the same requests' KV cache, paged vs reserved up front\n(in brackets: times the bytes of the "
                    "tokens themselves)", fontsize=10)
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


FIGURES = {
    "ch06_pool_grid.png": draw_pool_grid,
    "ch06_block_tables.png": draw_block_tables,
    "ch06_waste.png": draw_waste,
    "ch06_occupancy.png": draw_occupancy,
}
