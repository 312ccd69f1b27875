"""Chapter 2 figures, drawn from the real checkpoint: the file layout, bf16's bits, the memory plan."""
from __future__ import annotations

import matplotlib
import numpy as np
from matplotlib.figure import Figure  # no pyplot: the same code draws for files (Agg) and notebooks
from matplotlib.patches import Patch, Rectangle

from tinyvllm.formats.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from tinyvllm.formats.checkpoints import PRESETS, resolve_model
from tinyvllm.formats.config import load_config
from tinyvllm.formats.safetensors_format import SafetensorsFile
from tinyvllm.model.buffers import Region, blob_size, plan_buffers
from tinyvllm.model.weights import plan_weights, weight_kind

KIND_COLORS = {"embedding": "#4C72B0", "attention": "#DD8452", "mlp": "#55A868", "norm": "#C44E52"}
MIB = 2**20
MAX_TOKENS = 512  # the step size `python -m tinyvllm info` plans for


def default_file() -> SafetensorsFile:
    return SafetensorsFile(resolve_model("default") / "model.safetensors")


def _bars(ax, spans: list[tuple[str, int, int]], y: float, scale: float, edges: bool = False) -> None:
    """Draw (name, begin, end) byte spans as one horizontal bar, colored by kind."""
    for kind, color in KIND_COLORS.items():
        mine = [(b / scale, (e - b) / scale) for name, b, e in spans if weight_kind(name) == kind]
        ax.broken_barh(mine, (y - 0.3, 0.6), facecolors=color, edgecolor="white" if edges else "none")


def _legend(ax, below: float = -0.35) -> None:
    ax.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLORS.items()],
              loc="upper center", bbox_to_anchor=(0.5, below), ncol=4, frameon=False)


def draw_safetensors_layout() -> Figure:
    """The default model's file to scale, one layer to scale, and its first 48 bytes one by one."""
    f = default_file()
    size, data_start = f.path.stat().st_size, min(t.begin for t in f.tensors.values())
    spans = [(t.name, t.begin, t.end) for t in f.tensors.values()]
    fig = Figure(figsize=(11, 6.2), layout="tight")
    whole, layer, head = fig.subplots(3, 1, gridspec_kw={"height_ratios": [1, 1, 1.2]})

    _bars(whole, spans, 0, MIB)
    whole.set_xlim(0, size / MIB)
    whole.set_title(f"{f.path.name}: {size:,} bytes, {len(spans)} tensors, to scale", loc="left")
    whole.set_xlabel("MiB from the start of the file")
    whole.annotate(f"8-byte length + {data_start - 8:,}-byte JSON header\n({data_start / size:.3%} of the file)",
                   xy=(0, 0.3), xytext=(size / MIB * 0.25, 0.75), textcoords="data",
                   arrowprops={"arrowstyle": "->"}, fontsize=8, va="center")
    whole.set_ylim(-0.5, 1.1)
    whole.set_yticks([])

    layer_spans = [(n, b, e) for n, b, e in spans if n.startswith("model.layers.0.")]
    first = min(b for _, b, _ in layer_spans)
    _bars(layer, [(n, b - first, e - first) for n, b, e in layer_spans], 0, MIB, edges=True)
    for n, b, e in layer_spans:
        if e - b > 100_000:  # the two norm vectors are 1,152 bytes each: far too thin to label
            short = n.split(".")[-2].removesuffix("_proj")
            layer.text((b + e - 2 * first) / 2 / MIB, 0, short, ha="center", va="center", fontsize=7, color="white")
    norm_bytes = sum(e - b for n, b, e in layer_spans if weight_kind(n) == "norm")
    layer.set_title(f"layer 0 alone: seven matrices; its two norm vectors ({norm_bytes:,} bytes together) "
                    "are too thin to see", loc="left")
    layer.set_xlabel("MiB from the start of layer 0's first tensor")
    layer.set_yticks([])
    _legend(layer)

    with open(f.path, "rb") as fh:
        first_bytes = fh.read(48)
    for i, byte in enumerate(first_bytes):
        color = "#8172B3" if i < 8 else "#EEEEEE"
        head.add_patch(Rectangle((i, 0), 1, 1, facecolor=color, edgecolor="white"))
        label = f"{byte:02x}" if i < 8 else chr(byte)
        head.text(i + 0.5, 0.5, label, ha="center", va="center", fontsize=7 if i < 8 else 9,
                  color="white" if i < 8 else "black", family="monospace")
    n = int.from_bytes(first_bytes[:8], "little")
    head.text(4, -0.45, f"little-endian u64 = {n:,}", ha="center", fontsize=8)
    head.text(28, -0.45, "the JSON header begins (UTF-8 text)", ha="center", fontsize=8)
    head.set_xlim(0, 48)
    head.set_ylim(-0.8, 1.05)
    head.axis("off")
    head.set_title("the first 48 bytes, one box per byte", loc="left")
    return fig


def _bit_boxes(ax, bits: int, nbits: int, y: float, title: str) -> None:
    """One row of boxes: sign (1), exponent (8), mantissa (the rest), most significant bit first."""
    for i in range(nbits):
        bit = (bits >> (nbits - 1 - i)) & 1
        color = "#C44E52" if i == 0 else "#4C72B0" if i < 9 else "#55A868"
        ax.add_patch(Rectangle((i, y), 1, 0.8, facecolor=color, alpha=0.9 if bit else 0.25, edgecolor="white"))
        ax.text(i + 0.5, y + 0.4, str(bit), ha="center", va="center", fontsize=8)
    ax.text(-0.5, y + 0.4, title, ha="right", va="center", fontsize=8, family="monospace")


def draw_bf16_bits() -> Figure:
    """A real weight's bits as fp32 and bf16, rounding an fp32 to bf16, and the precision of each format."""
    f = default_file()
    name = "model.layers.0.self_attn.q_proj.weight"
    w_bits = int(f.get(name)[0, 0])
    w = float(bf16_bits_to_float32(np.array([w_bits], dtype=np.uint16))[0])
    rows = bf16_bits_to_float32(f.get(name)[:2])
    dot = np.dot(rows[0], rows[1])  # what a GEMM accumulates in fp32 before it writes a bf16 output
    dot_bits = int(np.array([dot], dtype=np.float32).view(np.uint32)[0])
    rounded_bits = int(float32_to_bf16_bits(np.array([dot], dtype=np.float32))[0])
    rounded = float(bf16_bits_to_float32(np.array([rounded_bits], dtype=np.uint16))[0])

    fig = Figure(figsize=(11, 7.5))
    bits_ax = fig.add_axes([0.22, 0.56, 0.75, 0.40])
    _bit_boxes(bits_ax, w_bits << 16, 32, 3.3, f"fp32 {w:+.6g}")
    _bit_boxes(bits_ax, w_bits, 16, 2.3, f"bf16 {w:+.6g}")
    _bit_boxes(bits_ax, dot_bits, 32, 1.0, f"fp32 {float(dot):+.9g}")
    _bit_boxes(bits_ax, rounded_bits, 16, 0.0, f"bf16 {rounded:+.6g}")
    bits_ax.text(0, 4.35, f"{name}[0, 0], a real weight: bf16 is the top half of the fp32, "
                          "so widening appends 16 zero bits", fontsize=9)
    bits_ax.text(0, 2.05, f"row 0 . row 1 of that matrix, accumulated in fp32, rounded to the nearest bf16: "
                          f"relative error {abs(rounded - dot) / abs(dot):.2e}", fontsize=9)
    for x, label in [(0.5, "sign"), (5, "exponent (8 bits)"), (12.5, "mantissa (7 in bf16)"),
                     (24.5, "+16 mantissa bits only fp32 has")]:
        bits_ax.text(x, -0.45, label, ha="center", fontsize=8)
    bits_ax.set_xlim(-0.2, 32.2)
    bits_ax.set_ylim(-0.7, 4.6)
    bits_ax.axis("off")

    ax = fig.add_axes([0.08, 0.07, 0.86, 0.38])
    x = np.logspace(-44, 38.5, 4000)
    for label, spacing, color in _spacings(x):
        ax.loglog(x, spacing, label=label, color=color, lw=0.8)
    weights = np.concatenate([bf16_bits_to_float32(f.get(n)).ravel()[::50] for n in f.tensors])
    mags = np.abs(weights[weights != 0])
    hist_ax = ax.twinx()
    hist_ax.hist(mags, bins=np.logspace(-12, 2, 120), color="gray", alpha=0.35)
    hist_ax.set_yticks([])
    hist_ax.set_xscale("log")
    ax.set_xlabel("|x|")
    ax.set_ylabel("gap to the next number / |x|")
    ax.set_title("relative spacing of representable numbers (gray: where this model's |weights| lie)", loc="left")
    ax.set_ylim(1e-8, 2)
    ax.set_xlim(1e-45, 1e39)
    ax.legend(loc="lower left", fontsize=8)
    return fig


def _spacings(x: np.ndarray):
    """(label, relative gap to the next representable number at x, color) for fp32, bf16, fp16."""
    x32 = x.astype(np.float32)
    fp32 = np.spacing(x32).astype(np.float64) / x
    b = float32_to_bf16_bits(x32)  # the gap between a bf16 and the next one up, read from their bits
    gap = bf16_bits_to_float32(b + np.uint16(1)).astype(np.float64) - bf16_bits_to_float32(b)
    bf16 = np.where(b < 0x7F7F, gap / x, np.nan)
    x16 = np.where(x < 65504, x, 0).astype(np.float16)  # fp16 tops out at 65,504
    fp16 = np.where(x16 > 0, np.spacing(x16).astype(np.float64) / x, np.nan)
    return [("fp32 (8-bit exponent, 23-bit mantissa)", fp32, "#4C72B0"),
            ("bf16 (8-bit exponent, 7-bit mantissa)", bf16, "#C44E52"),
            ("fp16 (5-bit exponent, 10-bit mantissa)", fp16, "#8172B3")]


def _memory_rows():
    smol = load_config(resolve_model("default"))
    llama = PRESETS["llama-3.2-1b"]
    return [("SmolLM2-135M, CPU (f32)", plan_weights(smol, "f32"), plan_buffers(smol, MAX_TOKENS, "f32")),
            ("SmolLM2-135M, GPU (bf16)", plan_weights(smol, "bf16"), plan_buffers(smol, MAX_TOKENS, "bf16")),
            ("Llama-3.2-1B, GPU (bf16)", plan_weights(llama, "bf16"), plan_buffers(llama, MAX_TOKENS, "bf16"))]


def draw_memory_map() -> Figure:
    """The two blobs a run allocates, to scale: all weights in one, all activation buffers in the other."""
    rows = _memory_rows()
    fig = Figure(figsize=(12, 3.8), layout="tight")
    wax, bax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    for y, (label, w, _) in enumerate(rows):
        _bars(wax, [(r.name, r.offset, r.offset + r.nbytes) for r in w], y, MIB)
        wax.text(blob_size(w) / MIB + 20, y, f"{blob_size(w) / MIB:,.1f} MiB, {len(w)} views", va="center", fontsize=8)
    wax.set_yticks(range(len(rows)), [r[0] for r in rows])
    wax.invert_yaxis()
    wax.set_xlim(0, max(blob_size(w) for _, w, _ in rows) / MIB * 1.3)
    wax.set_xlabel("MiB from the start of the weight blob")
    wax.set_title("the weight blob: one allocation, one view per tensor", loc="left")
    _legend(wax, below=-0.22)
    shades = matplotlib.colormaps["Greys"](np.linspace(0.25, 0.9, len(rows[0][2])))  # one shade per buffer
    for y, (_, _, b) in enumerate(rows):
        _buffer_bar(bax, b, y, shades)
        bax.text(blob_size(b) / MIB + 0.5, y, f"{blob_size(b) / MIB:.1f} MiB", va="center", fontsize=8)
    bax.set_yticks(range(len(rows)), ["" for _ in rows])
    bax.invert_yaxis()
    bax.set_xlim(0, max(blob_size(b) for *_, b in rows) / MIB * 1.25)
    bax.set_xlabel("MiB from the start of the buffer blob")
    bax.set_title(f"the buffer blob for a step of {MAX_TOKENS} tokens", loc="left")
    bax.legend(handles=[Patch(color=c, label=r.name) for c, r in zip(shades, rows[0][2])],
               loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, frameon=False, fontsize=8)
    return fig


def _buffer_bar(ax, regions: list[Region], y: float, shades) -> None:
    for r, color in zip(regions, shades):
        ax.broken_barh([(r.offset / MIB, r.nbytes / MIB)], (y - 0.3, 0.6), facecolors=color, edgecolor="white")


FIGURES = {
    "ch02_safetensors_layout.png": draw_safetensors_layout,
    "ch02_bf16_bits.png": draw_bf16_bits,
    "ch02_memory_map.png": draw_memory_map,
}
