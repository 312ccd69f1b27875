"""Chapter 1 figures, drawn from the real config and weights (`make figures`; the notebook calls the same)."""
from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyBboxPatch

from chapters.ch01_map import checkpoint
from tinyvllm import reference
from tinyvllm.formats import config
from tinyvllm.formats.checkpoints import PRESETS, resolve_model

COLORS = {"io": "#e8e8e8", "norm": "#fde2b8", "proj": "#c9dcf5", "rope": "#e3d2f3", "attn": "#f6c9c9",
          "mlp": "#cdebd0", "sum": "#ffffff"}


def _box(ax, x: float, y: float, w: float, h: float, title: str, detail: str = "", kind: str = "proj") -> None:
    """A rounded box centred at (x, y): a bold title, and the shapes below it in monospace."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                fc=COLORS[kind], ec="#444444", lw=1))
    lines = detail.count("\n") + 1 if detail else 0
    text_h = 0.24 + 0.19 * lines  # one 8 pt line is about 0.19 data units at this figure size
    ax.text(x, y + text_h / 2 - 0.12 if lines else y, title, ha="center", va="center", fontsize=9.5, weight="bold")
    if lines:
        ax.text(x, y - text_h / 2 + 0.09 * lines, detail, ha="center", va="center", fontsize=8, family="monospace")


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], label: str = "", color: str = "#333333",
           label_at: tuple[float, float] = (0.1, 0.0)) -> None:
    """An arrow from start to end; the label sits at the midpoint, moved by label_at."""
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, lw=1.1,
                                                          shrinkA=0, shrinkB=0))
    if label:
        ax.text((start[0] + end[0]) / 2 + label_at[0], (start[1] + end[1]) / 2 + label_at[1], label,
                fontsize=7.5, family="monospace", va="center", color=color)


def _params(*shape: int) -> str:
    n = int(np.prod(shape))
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def draw_forward_pass() -> plt.Figure:
    """One forward pass of the default model: every box carries the real shapes from its config.json."""
    model_dir = resolve_model("default")
    cfg = config.load_config(model_dir)
    hid, H, KVH, d, ffn, V, L = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                 cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers)
    fig = plt.figure(figsize=(11, 14))
    ax = fig.add_axes((0, 0, 1, 0.95))  # the whole figure: text sizes in data units stay predictable
    ax.set(xlim=(0, 12), ylim=(0, 19.4))
    ax.axis("off")
    cx, res, red = 4.8, 1.0, "#8a2a2a"  # centre column, residual-stream column, the decode-only parts

    _box(ax, cx, 18.75, 3.6, 0.6, "token ids", "(T,) int", "io")
    _box(ax, cx, 17.6, 4.8, 0.65, "embed_tokens (a row lookup)", f"({V}, {hid}) table -> x (T, {hid})", "io")
    _arrow(ax, (cx, 18.43), (cx, 17.94))
    # the decoder layer, repeated L times, around the residual stream
    ax.add_patch(FancyBboxPatch((0.3, 3.6), 8.3, 13.1, boxstyle="round,pad=0.02,rounding_size=0.2",
                                fc="none", ec="#777777", lw=1.3, ls="--"))
    ax.text(8.45, 16.4, f"decoder layer  x {L}", ha="right", fontsize=11, weight="bold", color="#555555")
    ax.plot([cx, cx, res], [17.27, 17.05, 17.05], color="#333333", lw=1.1)  # x enters the residual stream
    ax.plot([res, res], [17.05, 3.85], color="#aaaaaa", lw=4, zorder=0)
    ax.text(res - 0.15, 6.2, f"residual stream x  (T, {hid})", rotation=90, ha="right", va="center",
            fontsize=9, color="#666666")
    ax.plot([res, cx], [16.45, 16.45], color="#333333", lw=1.1)
    _box(ax, cx, 15.8, 4.4, 0.65, "RMSNorm (input_layernorm)", f"weight ({hid},)  eps {cfg.rms_norm_eps:g}", "norm")
    _arrow(ax, (cx, 16.45), (cx, 16.14))
    for x, name, heads in ((cx - 2.4, "q_proj", H), (cx, "k_proj", KVH), (cx + 2.4, "v_proj", KVH)):
        _box(ax, x, 14.45, 2.2, 0.85, name, f"{hid} -> {heads * d}\n{heads} heads x {d}", "proj")
        _arrow(ax, (x, 15.46), (x, 14.89))
    _box(ax, cx - 1.2, 13.05, 4.0, 0.65, "RoPE on q and k", f"{d // 2} pairs, theta {cfg.rope_theta:g}", "rope")
    for x in (cx - 2.4, cx):
        _arrow(ax, (x, 14.01), (x, 13.39))
    # the KV cache: K (after RoPE) and V of every past token, kept between forward passes
    _box(ax, 10.15, 12.55, 2.9, 1.55, "KV cache (layer i)",
         f"K, V: (S, {KVH}, {d}) each\nS = tokens so far\nall {L} layers: 2x{L}x{KVH * d}x4 B\n= {2 * L * KVH * d * 4:,} B/token",
         "io")
    _arrow(ax, (cx + 0.8, 13.05), (8.7, 13.05), f"k (T,{KVH},{d})", red, (-0.6, 0.15))
    _arrow(ax, (cx + 2.4, 14.01), (8.7, 13.6), f"v (T,{KVH},{d})", red, (0.0, 0.25))
    _box(ax, cx, 11.45, 6.8, 0.95, "causal GQA attention",
         f"softmax(q k^T / sqrt({d}), future masked) v\n{H} query heads read {KVH} K/V heads ({H // KVH} per group)",
         "attn")
    _arrow(ax, (cx - 2.4, 12.71), (cx - 2.4, 11.93), f"q (T,{H},{d})")
    _arrow(ax, (10.15, 11.77), (8.2, 11.5), f"K, V (S, {KVH}, {d})", red, (-0.5, -0.25))
    _box(ax, cx, 10.05, 4.4, 0.65, "o_proj", f"(T, {H * d}) -> (T, {hid})", "proj")
    _arrow(ax, (cx, 10.97), (cx, 10.39))
    _box(ax, res, 9.35, 0.42, 0.42, "+", "", "sum")
    _arrow(ax, (cx, 9.72), (res + 0.23, 9.38))
    ax.plot([res, cx], [8.8, 8.8], color="#333333", lw=1.1)
    _box(ax, cx, 8.2, 4.4, 0.65, "RMSNorm (post_attention)", f"weight ({hid},)", "norm")
    _arrow(ax, (cx, 8.8), (cx, 8.54))
    for x, name in ((cx - 1.5, "gate_proj"), (cx + 1.5, "up_proj")):
        _box(ax, x, 6.95, 2.6, 0.65, name, f"{hid} -> {ffn}", "mlp")
        _arrow(ax, (x, 7.86), (x, 7.29))
    _box(ax, cx, 5.7, 4.4, 0.65, "SwiGLU", f"silu(gate) * up  (T, {ffn})", "mlp")
    for x in (cx - 1.5, cx + 1.5):
        _arrow(ax, (x, 6.61), (x, 6.04))
    _box(ax, cx, 4.45, 4.4, 0.65, "down_proj", f"(T, {ffn}) -> (T, {hid})", "mlp")
    _arrow(ax, (cx, 5.36), (cx, 4.79))
    _box(ax, res, 4.1, 0.42, 0.42, "+", "", "sum")
    _arrow(ax, (cx - 2.2, 4.3), (res + 0.23, 4.13))
    # after the last layer
    ax.plot([res, res, cx], [3.88, 3.35, 3.35], color="#333333", lw=1.1)
    _box(ax, cx, 2.8, 4.4, 0.65, "RMSNorm (model.norm)", f"weight ({hid},)", "norm")
    _arrow(ax, (cx, 3.35), (cx, 3.14))
    tied = "tied: the embed_tokens table" if cfg.tie_word_embeddings else "its own weight"
    _box(ax, cx, 1.65, 5.4, 0.65, f"lm_head ({tied})", f"(T, {hid}) -> (T, {V})", "proj")
    _arrow(ax, (cx, 2.46), (cx, 1.99))
    _box(ax, cx, 0.5, 4.8, 0.65, f"logits (T, {V})", "argmax / sample -> next token id", "io")
    _arrow(ax, (cx, 1.31), (cx, 0.84))
    ax.plot([cx + 2.45, 11.8, 11.8, cx + 1.85], [0.5, 0.5, 18.75, 18.75], color=red, lw=1, ls=":")
    _arrow(ax, (cx + 1.95, 18.75), (cx + 1.82, 18.75), color=red)
    ax.text(11.7, 1.0, "decode: the new id goes\nback in alone (T = 1);\nK, V of the past come\nfrom the cache",
            ha="right", fontsize=8, color=red)
    per_layer = 2 * hid * H * d + 2 * hid * KVH * d + 3 * hid * ffn
    ax.set_title(f"{model_dir.name}: one forward pass over T tokens\n"
                 f"{L} layers x {_params(per_layer)} weights + a {_params(V, hid)} embedding table", fontsize=12)
    return fig


def draw_rope_frequencies() -> plt.Figure:
    """Llama 3.2 1B: each frequency pair's wavelength, with and without llama3 scaling."""
    cfg = PRESETS["llama-3.2-1b"]
    s = cfg.rope_scaling
    scaled = reference.rope_inv_freq(cfg).astype(np.float64)
    plain = reference.rope_inv_freq(replace(cfg, rope_scaling=None)).astype(np.float64)
    pairs = np.arange(len(plain))
    old = s["original_max_position_embeddings"]
    high_wl, low_wl = old / s["high_freq_factor"], old / s["low_freq_factor"]

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    left.semilogy(pairs, 2 * np.pi / plain, "o-", ms=3.5, label=f"rope_theta {cfg.rope_theta:g} only")
    left.semilogy(pairs, 2 * np.pi / scaled, "s-", ms=3.5, label=f"llama3 scaling (factor {s['factor']:g})")
    for y, name in ((high_wl, "high_freq_factor"), (low_wl, "low_freq_factor")):
        left.axhline(y, color="gray", ls="--", lw=0.8)
        left.text(0.5, y * 1.25, f"{old} / {name} = {y:g}", fontsize=8, color="gray")
    left.set(xlabel=f"frequency pair i (dims i and i + {cfg.head_dim // 2})",
             ylabel="wavelength: positions per full turn", title="Llama 3.2 1B: RoPE wavelength per pair")
    left.legend(loc="upper left", fontsize=8)
    right.plot(pairs, plain / scaled, "o-", ms=3.5, color="C1")
    right.set(xlabel="frequency pair i", ylabel="slow-down: plain / scaled inv_freq",
              title="llama3 scaling: how much slower each pair turns")
    ramp = pairs[(2 * np.pi / plain >= high_wl) & (2 * np.pi / plain <= low_wl)]
    right.axvspan(ramp[0] - 0.5, ramp[-1] + 0.5, color="C1", alpha=0.12)
    right.text(ramp[0] - 0.8, s["factor"] / 2, f"ramp: pairs {ramp[0]}-{ramp[-1]}", ha="right", fontsize=9)
    right.text(1, 3, f"kept: wavelength < {high_wl:g}", fontsize=9)
    right.text(pairs[-1], s["factor"] - 3, f"divided by {s['factor']:g}:\nwavelength > {low_wl:g}", ha="right",
               fontsize=9)
    fig.tight_layout()
    return fig


def draw_attention_heads() -> plt.Figure:
    """Two real heads of the default model on the chapter's prompt: a previous-token head and a sink head."""
    m = checkpoint.load()
    ids = m.tok.apply_chat_template(checkpoint.MESSAGES)
    labels = [m.tok.decode([i]).replace("\n", "\\n") for i in ids]
    fig, axes = plt.subplots(1, 2, figsize=(15, 7.4))
    for ax, (layer, head) in zip(axes, ((2, 1), (8, 0))):
        p = checkpoint.attention_probs(m.model, ids, layer, head)
        prev = np.mean(np.diagonal(p, offset=-1))
        ax.imshow(p, cmap="magma_r", vmin=0, vmax=1)
        ax.set_xticks(range(len(ids)), labels, rotation=90, fontsize=6.5)
        ax.set_yticks(range(len(ids)), labels, fontsize=6.5)
        ax.set(xlabel="key (earlier token)", ylabel="query (token reading)")
        ax.set_title(f"layer {layer}, head {head}: mean weight on the previous token {prev:.2f}, "
                     f"on the first token {p[1:, 0].mean():.2f}", fontsize=9.5)
    fig.suptitle("attention probabilities on the chapter's prompt (upper triangle = future, masked to 0)",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


FIGURES = {
    "ch01_forward_pass.png": draw_forward_pass,
    "ch01_rope_frequencies.png": draw_rope_frequencies,
    "ch01_attention_heads.png": draw_attention_heads,
}
