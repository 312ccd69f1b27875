"""Chapter 1 exercises: the pieces of a Llama layer, in NumPy float32.

Each function has the signature and docstring of the engine function it re-implements (REFERENCE
says which). Replace each `raise NotImplementedError` with your code, then:

    make grade CH=1                   # the graders compare your functions with transformers/torch
    make chapter-1 IMPL=student       # the real model answers with your functions plugged in
    .venv/bin/python -m pytest tests/test_ch01_exercises.py --impl=student -x
                                      # the graders alone: the first failure, with its traceback

Keep everything float32: NumPy 2 turns float32 * float64 into float64, so a stray np.float64 constant
or a float64 intermediate leaks into the result (the graders check the dtype).
"""
from __future__ import annotations

import numpy as np

from tinyvllm.formats.config import LlamaConfig

REFERENCE = {
    "rms_norm": "tinyvllm.reference:rms_norm",
    "rope_inv_freq": "tinyvllm.reference:rope_inv_freq",
    "apply_rope": "tinyvllm.reference:apply_rope",
    "softmax": "tinyvllm.reference:softmax",
    "attention": "tinyvllm.reference:attention",
}


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis. x: (T, hidden).

    Each row is divided by its root-mean-square, then scaled per channel by `weight` (hidden,).
    Unlike LayerNorm there is no mean subtraction and no bias. `eps` goes inside the square root:
    it only matters for rows that are almost zero, where it keeps the division finite.
    The result is a new array of x's shape, float32; x itself is left as it was (the model still needs
    it: it is the residual stream each layer adds to).
    """
    raise NotImplementedError("Exercise 1.1: rms_norm")


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """The rotation speed of each of the head_dim/2 frequency pairs, with llama3 scaling if configured.

    Pair i turns by inv_freq[i] radians per position: inv_freq[i] = rope_theta ** (-2i / head_dim),
    i = 0 .. head_dim/2 - 1, so pair 0 spins fastest and the last pair slowest. Its wavelength (the
    positions for one full turn) is 2*pi / inv_freq[i].

    If cfg.rope_scaling is a dict (Llama 3.1/3.2: keys factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings), stretch the slow pairs to reach longer contexts. With
    old = original_max_position_embeddings:
      - wavelength < old / high_freq_factor: keep inv_freq (these pairs encode local order);
      - wavelength > old / low_freq_factor: divide inv_freq by factor;
      - in between, blend: smooth = (old / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
        and inv_freq * ((1 - smooth) / factor + smooth).
    Returns (head_dim // 2,) float32. (float32 arithmetic is precise enough here: rope_theta ** x in
    float32 lands within 4e-7, relative, of float64 for head_dim 16 to 256 and theta up to 1e6, and
    transformers itself computes it in float32. Only the result's dtype matters: return float32.)
    """
    raise NotImplementedError("Exercise 1.2: rope_inv_freq")


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each (x[i], x[i + d/2]) pair by its position's angle. x: (T, heads, d); cos, sin: (T, d).

    HF's "rotate half" layout pairs dimension i with dimension i + d/2 (not i with i + 1), and cos/sin
    hold each pair's angle twice: cos[t, i] == cos[t, i + d/2]. A 2-D rotation of (a, b) by angle θ is
    (a cos θ - b sin θ, b cos θ + a sin θ). Every head of a token uses the same angles.
    Returns an array of x's shape, float32.
    """
    raise NotImplementedError("Exercise 1.3: apply_rope")


def softmax(x: np.ndarray) -> np.ndarray:
    """Numerically safe softmax over the last axis (subtract the row max first).

    exp(80) overflows float32, and attention scores can be that large; subtracting each row's max
    changes nothing mathematically and keeps every exp() <= 1. Entries of -inf (masked) get
    probability 0. Returns x's shape, float32, rows summing to 1.
    """
    raise NotImplementedError("Exercise 1.4: softmax")


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start_pos: int) -> np.ndarray:
    """Causal GQA attention. q: (T, H, d) at positions start_pos.., k, v: (S, KVH, d) at positions 0..S-1.

    Query head h reads key/value head h // (H / KVH): groups of query heads share one K/V head.

    For query t (position start_pos + t) and head h: scores over keys s = q[t, h] . k[s, h // G] / sqrt(d),
    keys after the query's position are masked to -inf (causal), probabilities = softmax(scores), and
    the output is the probability-weighted sum of v[s, h // G]. T == S and start_pos == 0 is a prefill;
    T == 1 and start_pos == S - 1 is one decode step reading the KV cache. Returns (T, H * d) float32,
    heads side by side — the layout o_proj expects. Avoid Python loops over tokens: batch with matmul.
    """
    raise NotImplementedError("Exercise 1.5: attention")
