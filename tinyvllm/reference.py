"""Chapter 1: the map. The whole Llama forward pass in readable NumPy float32 — the oracle.

Every faster path in tinyvllm (the CUDA kernels, the paged cache, the batched engine) is checked
against this file, and this file is checked against HF transformers. Shapes, with T tokens:

    ids (T,) -> embed (T, hidden) -> layers x [RMSNorm -> attention -> +residual
                                               RMSNorm -> SwiGLU MLP -> +residual]
             -> RMSNorm -> lm_head -> logits (T, vocab)
"""
from __future__ import annotations

import numpy as np

from tinyvllm.formats.config import LlamaConfig, rope_inv_freq  # noqa: F401  (chapter 1's exercise 1.2: it lives with the config)

F32 = np.float32


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis. x: (T, hidden)."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return x / np.sqrt(variance + F32(eps)) * weight


def rope_cos_sin(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, frequency) angle, (T, head_dim) each."""
    angles = np.outer(np.asarray(positions, dtype=F32), inv_freq)  # (T, d/2)
    angles = np.concatenate([angles, angles], axis=-1)  # HF pairs dim i with dim i + d/2 ("rotate half")
    return np.cos(angles).astype(F32), np.sin(angles).astype(F32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate each (x[i], x[i + d/2]) pair by its position's angle. x: (T, heads, d); cos, sin: (T, d)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def softmax(x: np.ndarray) -> np.ndarray:
    """Numerically safe softmax over the last axis (subtract the row max first)."""
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start_pos: int) -> np.ndarray:
    """Causal GQA attention. q: (T, H, d) at positions start_pos.., k, v: (S, KVH, d) at positions 0..S-1.

    Query head h reads key/value head h // (H / KVH): groups of query heads share one K/V head.
    """
    T, H, d = q.shape
    S, kv_heads, _ = k.shape
    group = H // kv_heads
    qg = q.reshape(T, kv_heads, group, d).transpose(1, 2, 0, 3)     # (KVH, G, T, d)
    kt = k.transpose(1, 2, 0)[:, None]                               # (KVH, 1, d, S)
    scores = (qg @ kt) * F32(1.0 / np.sqrt(d))                       # (KVH, G, T, S)
    future = np.arange(S)[None, :] > (start_pos + np.arange(T))[:, None]  # key after query: masked
    scores = np.where(future, F32(-np.inf), scores)
    out = softmax(scores) @ v.transpose(1, 0, 2)[:, None]            # (KVH, G, T, d)
    return out.transpose(2, 0, 1, 3).reshape(T, H * d)


def online_softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start_pos: int,
                             block: int) -> np.ndarray:
    """attention(), computed as the prefill kernel does: keys in tiles of `block`, a running max and sum.

    The (T, S) scores never exist whole: per (head, query), the running max m, the sum denom of exp(score - m)
    and the output o are rescaled by exp(m_old - m_new) whenever a tile raises the max. Same result.
    """
    T, H, d = q.shape
    kv_heads = k.shape[1]
    group = H // kv_heads
    qg = q.reshape(T, kv_heads, group, d).transpose(1, 2, 0, 3)    # (KVH, G, T, d)
    m = np.full((kv_heads, group, T, 1), -np.inf, F32)
    denom = np.zeros((kv_heads, group, T, 1), F32)
    o = np.zeros((kv_heads, group, T, d), F32)
    last = min(k.shape[0], start_pos + T)                            # later keys: every query's future
    for k0 in range(0, last, block):
        keys = np.arange(k0, min(k0 + block, last))
        s = (qg @ k[keys].transpose(1, 2, 0)[:, None]) * F32(1.0 / np.sqrt(d))   # (KVH, G, T, tile)
        s = np.where(keys[None, :] > (start_pos + np.arange(T))[:, None], F32(-np.inf), s)
        # the running max, never the tile's own: a row whose keys in this tile are all in its future has a
        # tile max of -inf, and exp(-inf - -inf) is NaN. m_new is finite: every query sees key 0 (tile 0).
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        p, alpha = np.exp(s - m_new), np.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=-1, keepdims=True)
        o = o * alpha + p @ v[keys].transpose(1, 0, 2)[:, None]
        m = m_new
    return (o / denom).transpose(2, 0, 1, 3).reshape(T, H * d)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1) + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The Llama MLP's gate: silu(x W_gate^T) * (x W_up^T)."""
    return silu(gate) * up


def stack_rows(mats: list[np.ndarray]) -> np.ndarray:
    """Matrices that read the same input, one under the other: (out_1 + out_2 + ..., in).

    A decode step is one vector times each matrix: one BLAS call over the stack replaces one call (and
    one wake-up of BLAS's threads) per matrix. The weight blob already holds q, k, v (and gate, up) back
    to back, so the stack is then a view of that memory; anything else is copied.
    """
    back_to_back = all(m.flags.c_contiguous for m in mats) and all(
        a.dtype == b.dtype and a.shape[1:] == b.shape[1:] and a.ctypes.data + a.nbytes == b.ctypes.data
        for a, b in zip(mats, mats[1:]))
    if not back_to_back:
        return np.concatenate(mats)
    first, rows = mats[0], sum(m.shape[0] for m in mats)
    return np.lib.stride_tricks.as_strided(first, (rows, *first.shape[1:]), first.strides, writeable=False)


class KVCache:
    """Contiguous K/V for one sequence: (layers, max_len, kv_heads, head_dim) each, filled up to `length`."""

    def __init__(self, cfg: LlamaConfig, max_len: int):
        shape = (cfg.num_hidden_layers, max_len, cfg.num_key_value_heads, cfg.head_dim)
        self.k, self.v = np.zeros(shape, F32), np.zeros(shape, F32)
        self.length = 0


class ReferenceModel:
    """Llama in NumPy. `weights` maps HF tensor names to float32 arrays of the HF (out, in) layout."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, np.ndarray]):
        self.cfg, self.w = cfg, weights
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])  # tied if absent
        self.inv_freq = rope_inv_freq(cfg)
        # Prepare step, for speed only: one (q + 2 kv, hidden) and one (2 ffn, hidden) matrix per layer,
        # so each layer runs 4 matmuls instead of 7; self.w keeps the HF names and tensors.
        layer = "model.layers.{}.".format
        self.qkv = [stack_rows([weights[layer(i) + f"self_attn.{n}_proj.weight"] for n in "qkv"])
                    for i in range(cfg.num_hidden_layers)]
        self.gate_up = [stack_rows([weights[layer(i) + f"mlp.{n}_proj.weight"] for n in ("gate", "up")])
                        for i in range(cfg.num_hidden_layers)]

    def new_cache(self, max_len: int | None = None) -> KVCache:
        return KVCache(self.cfg, max_len or self.cfg.max_position_embeddings)

    def forward(self, token_ids, cache: KVCache | None = None, all_logits: bool = True) -> np.ndarray:
        """Run tokens at positions cache.length.. (0 without a cache); logits (T, vocab), or (vocab,) for the last."""
        cache = cache or self.new_cache(len(token_ids))
        start, T = cache.length, len(token_ids)
        positions = slice(start, start + T)
        cos, sin = rope_cos_sin(self.inv_freq, np.arange(start, start + T))
        x = self.w["model.embed_tokens.weight"][np.asarray(token_ids)]  # (T, hidden)
        for i in range(self.cfg.num_hidden_layers):
            q, cache.k[i, positions], cache.v[i, positions] = self.project_qkv(i, x, cos, sin)
            x = x + self.attention_block(i, q, cache.k[i, :start + T], cache.v[i, :start + T], start)
            x = x + self.mlp_block(i, x)
        cache.length = start + T
        if not all_logits:
            x = x[-1:]  # prefill only needs the last position's logits: skip (T-1) x vocab of work
        logits = self.lm_head_logits(x)
        return logits if all_logits else logits[0]

    # One layer in three parts (forward above; chapter 1's map and chapter 3's checks show each part)

    def project_qkv(self, i: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray):
        """Layer i: RMSNorm, one (q + 2 kv) projection, RoPE on Q and K: q (T, H, d), k and v (T, KVH, d)."""
        cfg, T = self.cfg, len(x)
        h = rms_norm(x, self.w[f"model.layers.{i}.input_layernorm.weight"], cfg.rms_norm_eps)
        qkv = h @ self.qkv[i].T  # (T, q + 2 kv): Q, K and V side by side
        q = qkv[:, :cfg.q_size].reshape(T, -1, cfg.head_dim)
        k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].reshape(T, -1, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(T, -1, cfg.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attention_block(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int = 0) -> np.ndarray:
        """Layer i's attention of q (at positions start..) over keys 0.., after o_proj: (T, hidden), to add to x."""
        return attention(q, k, v, start) @ self.w[f"model.layers.{i}.self_attn.o_proj.weight"].T

    def mlp_block(self, i: int, x: np.ndarray) -> np.ndarray:
        """Layer i's RMSNorm + SwiGLU MLP: (T, hidden), to add to x."""
        cfg = self.cfg
        h = rms_norm(x, self.w[f"model.layers.{i}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate_up = h @ self.gate_up[i].T  # (T, 2 ffn): gate, then up
        gate, up = gate_up[:, :cfg.intermediate_size], gate_up[:, cfg.intermediate_size:]
        return swiglu(gate, up) @ self.w[f"model.layers.{i}.mlp.down_proj.weight"].T

    def lm_head_logits(self, x: np.ndarray) -> np.ndarray:
        """Final RMSNorm, then one score per vocabulary entry: (T, vocab)."""
        return rms_norm(x, self.w["model.norm.weight"], self.cfg.rms_norm_eps) @ self.lm_head.T
