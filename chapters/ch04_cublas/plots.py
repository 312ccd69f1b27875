"""Chapter 4 figures: row-major vs column-major memory order, and the GEMM table of a layer."""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure  # no pyplot: the same code draws for files (Agg) and notebooks
from matplotlib.patches import FancyArrowPatch, Rectangle

from chapters.ch04_cublas.checkpoint import BUFFERS, layer_gemms
from tinyvllm.formats.bf16 import bf16_bits_to_float32
from tinyvllm.formats.checkpoints import PRESETS, resolve_model
from tinyvllm.formats.config import load_config
from tinyvllm.formats.safetensors_format import SafetensorsFile
from tinyvllm.model import gemm
from tinyvllm.model.gemm import OP_N, OP_T

ROW, COL = "#4C72B0", "#DD8452"  # row-major order in blue, column-major order in orange
WEIGHT = "model.layers.0.self_attn.q_proj.weight"
TABLE_T = 128  # the step size the table is drawn for: only n depends on it
GEMM_COLORS = {"qkv": "#DD8452", "o_proj": "#C44E52", "gate_up": "#55A868", "down": "#8172B3",
               "lm_head": "#4C72B0"}


def small_matrix(rows: int = 3, cols: int = 4) -> tuple[int, np.ndarray]:
    """(first row, block): the first rows x cols block of a real weight, at the left edge, whose values all
    differ at three decimals (the quantized checkpoint repeats values; repeats would hide the order)."""
    w = SafetensorsFile(resolve_model("default") / "model.safetensors").get(WEIGHT)
    for r in range(w.shape[0] - rows):
        block = bf16_bits_to_float32(np.ascontiguousarray(w[r:r + rows, :cols]))
        if len(set(np.round(block, 3).ravel())) == block.size:
            return r, block
    raise ValueError(f"no {rows} x {cols} block of {WEIGHT} has distinct values")


def _grid(ax, a: np.ndarray, order: np.ndarray, color: str, title: str) -> None:
    """Matrix a as boxes, each with its value and (small, in the corner) its position in memory."""
    rows, cols = a.shape
    for i in range(rows):
        for j in range(cols):
            ax.add_patch(Rectangle((j, rows - 1 - i), 1, 1, facecolor="white", edgecolor="gray"))
            ax.text(j + 0.5, rows - 1 - i + 0.45, f"{a[i, j]:+.3f}", ha="center", va="center", fontsize=9)
            ax.text(j + 0.08, rows - 1 - i + 0.92, str(order[i, j]), ha="left", va="top", fontsize=7,
                    color=color, fontweight="bold")
    path = [np.argwhere(order == n)[0] for n in range(a.size)]
    down = rows > 1 and order[1, 0] == 1  # memory runs down the columns: arrows along the right edge

    def anchor(i, j):  # beside the value, not through it
        return (j + 0.88, rows - 1 - i + 0.5) if down else (j + 0.5, rows - 1 - i + 0.18)
    for (i0, j0), (i1, j1) in zip(path, path[1:]):  # arrows from each element to the next one in memory
        jump = i0 != i1 and j0 != j1  # the wrap to the next row (or column): drawn faint
        ax.add_patch(FancyArrowPatch(anchor(i0, j0), anchor(i1, j1),
                                     arrowstyle="->", mutation_scale=9, color=color, alpha=0.3 if jump else 0.8,
                                     linestyle="--" if jump else "-", connectionstyle="arc3,rad=0.1"))
    ax.set_xlim(-0.1, cols + 0.1)
    ax.set_ylim(-0.1, rows + 0.1)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)


def _strip(ax, values: np.ndarray, labels: list[str], color: str, y: float, title: str) -> None:
    """A flat buffer: one box per element, in memory order, with the element's (i, j) under it."""
    for n, (value, label) in enumerate(zip(values, labels)):
        ax.add_patch(Rectangle((n, y), 1, 0.8, facecolor=color, alpha=0.15, edgecolor=color))
        ax.text(n + 0.5, y + 0.4, f"{value:+.3f}", ha="center", va="center", fontsize=8)
        ax.text(n + 0.5, y - 0.15, label, ha="center", va="top", fontsize=7, color="dimgray")
        ax.text(n + 0.5, y + 0.95, str(n), ha="center", va="bottom", fontsize=7, color=color, fontweight="bold")
    ax.add_patch(FancyArrowPatch((0, y + 1.45), (len(values), y + 1.45), arrowstyle="->", mutation_scale=12,
                                 color=color))
    ax.text(0, y + 1.6, title, ha="left", va="bottom", fontsize=9)


def draw_memory_order() -> Figure:
    """A 3 x 4 corner of a real weight, its row-major and column-major buffers, and the trick in one picture."""
    first, a = small_matrix()
    rows, cols = a.shape
    i, j = np.indices(a.shape)
    row_order = i * cols + j                                    # row-major: a row's elements are neighbours
    col_order = np.vectorize(gemm.colmajor_index)(i, j, rows)  # column-major, ld = rows
    fig = Figure(figsize=(12, 7.2))
    top = fig.subplots(1, 3, gridspec_kw={"left": 0.03, "right": 0.97, "top": 0.92, "bottom": 0.5,
                                          "wspace": 0.15})
    _grid(top[0], a, row_order, ROW, f"A ({rows} x {cols}), row-major:\nthe next element is to the right")
    _grid(top[1], a, col_order, COL, f"A ({rows} x {cols}), column-major:\nthe next element is below")
    _grid(top[2], a.T, row_order.T, ROW, f"A's row-major buffer read column-major\n"
                                         f"(ld = {cols}) is A^T ({cols} x {rows})")
    fig.text(0.03, 0.97, f"A = {WEIGHT}[{first}:{first + rows}, :{cols}] of the default model; "
             "small numbers: position in memory",
             fontsize=9)
    ax = fig.add_axes([0.03, 0.02, 0.94, 0.42])
    _strip(ax, a.ravel(order="C"), [f"({p},{q})" for p, q in zip(i.ravel(order="C"), j.ravel(order="C"))],
           ROW, 2.6, "row-major buffer (NumPy, PyTorch, safetensors, this engine): row 0, then row 1, ...")
    _strip(ax, a.ravel(order="F"), [f"({p},{q})" for p, q in zip(i.ravel(order="F"), j.ravel(order="F"))],
           COL, 0.0, "column-major buffer (Fortran BLAS, cuBLAS): column 0, then column 1, ...")
    ax.set_xlim(-0.2, a.size + 0.2)
    ax.set_ylim(-0.6, 4.6)
    ax.axis("off")
    return fig


def _table_rows(cfg) -> list[list[str]]:
    flag = {OP_N: "N", OP_T: "T"}
    gemms = layer_gemms(cfg)
    layer = sum(g.flops_per_token for g in gemms[:-1])
    rows = []
    for g in gemms:
        p = gemm.gemm_params(TABLE_T, g.N, g.K)
        share = f"{g.flops_per_token / layer:.0%} of a layer" if g.name != "lm_head" else "per sampled token"
        rows.append([g.name, " -> ".join(BUFFERS[g.name]), f"({g.N}, {g.K})", f"(T, {g.N}) = (T, {g.K}) W^T",
                     flag[p["transa"]], flag[p["transb"]],
                     *(f" {p[k]:,} " for k in ("m", "n", "k", "lda", "ldb", "ldc")),  # spaces: cell padding
                     f"{g.flops_per_token / 1e6:,.2f}", share])
    return rows


def _draw_table(ax, cfg) -> None:
    header = ["gemm", "X -> Y (buffers)", "W (N, K)", "Y = X W^T", "transa", "transb", "m", f"n (T={TABLE_T})",
              "k", "lda", "ldb", "ldc", "MFLOP/token", "share"]
    ax.axis("off")
    table = ax.table(cellText=_table_rows(cfg), colLabels=header, loc="upper center", cellLoc="center")
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1, 1.45)
    table.auto_set_column_width(list(range(len(header))))
    for (r, c), cell in table.get_celld().items():
        if r == 0:
            cell.set_facecolor("#EEEEEE")
        elif c == 0:
            cell.set_facecolor(GEMM_COLORS[cell.get_text().get_text()])
            cell.get_text().set_color("white")
        elif 4 <= c <= 11:
            cell.set_facecolor("#F4F8FC")  # the cublasGemmEx parameters: what the exercises ask for


def _draw_flops_bar(ax, cfg) -> None:
    """Where one token's GEMM FLOPs go over the whole model: every layer's four GEMMs, then the lm_head once."""
    gemms = layer_gemms(cfg)
    parts = [(g.name, g.flops_per_token * (1 if g.name == "lm_head" else cfg.num_hidden_layers)) for g in gemms]
    total, left = sum(f for _, f in parts), 0.0
    for name, flops in parts:
        ax.barh(0, flops / total, left=left, color=GEMM_COLORS[name], edgecolor="white")
        ax.text(left + flops / total / 2, 0, f"{name} {flops / total:.0%}", ha="center", va="center", fontsize=8,
                color="white")
        left += flops / total
    ax.set_xlim(0, 1)
    ax.axis("off")
    ax.set_title(f"one decode step's {total / 1e9:.2f} GFLOP of GEMMs (2 per weight): each layer GEMM "
                 f"x {cfg.num_hidden_layers} layers, the lm_head once", loc="left", fontsize=9)


def draw_gemm_table() -> Figure:
    """The cublasGemmEx parameters of every GEMM of one layer, for the default model and Llama 3.2 1B."""
    default_dir = resolve_model("default")
    models = [(f"{default_dir.name} (default)", load_config(default_dir)),
              ("Llama-3.2-1B", PRESETS["llama-3.2-1b"])]
    fig = Figure(figsize=(15, 6.2))
    axes = fig.subplots(4, 1, gridspec_kw={"height_ratios": [2.1, 0.4, 2.1, 0.4], "hspace": 0.55, "left": 0.01,
                                           "right": 0.99, "top": 0.9, "bottom": 0.02})
    for (table_ax, bar_ax), (name, cfg) in zip([axes[:2], axes[2:]], models):
        table_ax.set_title(f"{name}: hidden {cfg.hidden_size}, q {cfg.q_size}, kv {cfg.kv_size}, "
                           f"FFN {cfg.intermediate_size}, vocab {cfg.vocab_size:,}, {cfg.num_hidden_layers} layers",
                           loc="left", fontsize=10)
        _draw_table(table_ax, cfg)
        _draw_flops_bar(bar_ax, cfg)
    fig.text(0.01, 0.96, "cublasGemmEx(handle, transa, transb, m, n, k, 1, A = W, lda, B = X, ldb, 0, C = Y, ldc): "
             "row-major Y = X W^T asked for as column-major Y^T = W X^T", fontsize=10, family="monospace")
    return fig


FIGURES = {
    "ch04_memory_order.png": draw_memory_order,
    "ch04_gemm_table.png": draw_gemm_table,
}
