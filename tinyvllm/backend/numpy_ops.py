"""The NumPy twins of the CUDA kernels: same names, signatures and buffer layouts, float32 storage.

Each reads its inputs and writes its `out` buffer in place, exactly like the kernel it mirrors
(tinyvllm/kernels/<name>.cu), so the engine code above does not know which one it calls.
"""
from __future__ import annotations

import numpy as np

from tinyvllm import reference
from tinyvllm.gemm import gemm_numpy as gemm  # noqa: F401  (part of the backend's interface)

xp = np
DTYPE = np.float32  # activations and weights; the GPU stores bf16 bits here


def free_cached_memory() -> None:
    """Nothing to do: NumPy gives an array's memory back as soon as its last reference goes."""


def blob(nbytes: int) -> np.ndarray:
    """One aligned allocation to carve named views from (NumPy alone only promises 16 bytes)."""
    from tinyvllm.buffers import aligned_empty
    return aligned_empty(nbytes)


def to_device(a: np.ndarray, dtype=None) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=dtype)


def to_host(a: np.ndarray) -> np.ndarray:
    return a


def upload_weight(a: np.ndarray) -> np.ndarray:
    """A checkpoint tensor (bf16 bits as uint16, or f16/f32) -> this backend's storage: float32."""
    from tinyvllm.weights import to_float32
    return to_float32(a)


def embedding(ids: np.ndarray, table: np.ndarray, residual: np.ndarray) -> None:
    residual[...] = table[ids]


def add_rms_norm(residual: np.ndarray, delta: np.ndarray | None, weight: np.ndarray, out: np.ndarray,
                 eps: float) -> None:
    if delta is not None:
        residual += delta
    out[...] = reference.rms_norm(residual, weight, eps)


def rope(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, num_heads: int,
         head_dim: int) -> None:
    """Rotate the first num_heads heads of each row (Q heads then K heads) in place."""
    x = qkv[:, :num_heads * head_dim].reshape(len(positions), num_heads, head_dim)
    c, s = cos[positions], sin[positions]                       # (T, d/2) from the shared tables
    x[...] = reference.apply_rope(x, np.concatenate([c, c], -1), np.concatenate([s, s], -1))


def prefill_attention(qkv: np.ndarray, out: np.ndarray, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> None:
    T, q_cols, kv_cols = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_cols].reshape(T, num_heads, head_dim)
    k = qkv[:, q_cols:q_cols + kv_cols].reshape(T, num_kv_heads, head_dim)
    v = qkv[:, q_cols + kv_cols:q_cols + 2 * kv_cols].reshape(T, num_kv_heads, head_dim)
    out[...] = reference.attention(q, k, v, start_pos=0)


def swiglu(gate_up: np.ndarray, act: np.ndarray) -> None:
    inter = act.shape[1]
    act[...] = reference.swiglu(gate_up[:, :inter], gate_up[:, inter:])


def argmax(logits: np.ndarray, out: np.ndarray) -> None:
    out[...] = np.argmax(logits, axis=-1)


def store_kv(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray,
             num_heads: int) -> None:
    """Row t's K and V columns (after the num_heads Q heads) -> slot slots[t] of this layer's cache."""
    _, kv_heads, head_dim = k_cache.shape
    q_cols, kv_cols = num_heads * head_dim, kv_heads * head_dim
    k_cache[slots] = qkv[:, q_cols:q_cols + kv_cols].reshape(-1, kv_heads, head_dim)
    v_cache[slots] = qkv[:, q_cols + kv_cols:q_cols + 2 * kv_cols].reshape(-1, kv_heads, head_dim)


DECODE_SPLITS = 32  # the kernel's thread groups for head_dim 64: the context is cut into this many chunks


def decode_attention(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, starts: np.ndarray,
                     lengths: np.ndarray, out: np.ndarray, num_heads: int) -> None:
    """One new query per row b (qkv[b]'s Q heads) against keys in slots starts[b] .. starts[b] + lengths[b] - 1.

    As the kernel does it: the context is cut into DECODE_SPLITS chunks (one per thread group), each
    chunk gets its own max, sum and output, and the chunks are merged with online softmax's rescaling.
    """
    _, kv_heads, head_dim = k_cache.shape
    for b, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        q = qkv[b, :num_heads * head_dim].reshape(kv_heads, num_heads // kv_heads, head_dim)
        keys = slice(start, start + length)
        out[b] = attend_in_chunks(q, k_cache[keys], v_cache[keys]).reshape(-1)


def attend_in_chunks(q: np.ndarray, k: np.ndarray, v: np.ndarray, splits: int = DECODE_SPLITS) -> np.ndarray:
    """q (kv_heads, group, d) — the query heads sharing each K/V head; k, v (L, kv_heads, d). Returns
    (kv_heads, group, d): softmax(q k^T / sqrt(d)) v, computed chunk by chunk and merged."""
    length, kv_heads, d = k.shape
    chunk = -(-length // splits)                     # keys per chunk; trailing chunks may be empty
    pad = splits * chunk - length
    k = np.concatenate([k, np.zeros((pad, kv_heads, d), k.dtype)]).reshape(splits, chunk, kv_heads, d)
    v = np.concatenate([v, np.zeros((pad, kv_heads, d), v.dtype)]).reshape(splits, chunk, kv_heads, d)
    scores = np.einsum("hgd,sthd->shgt", q, k) / np.float32(np.sqrt(d))   # (splits, kv_heads, group, chunk)
    padding = (np.arange(splits * chunk) >= length).reshape(splits, 1, 1, chunk)
    scores = np.where(padding, np.float32(-np.inf), scores)               # padding keys weigh nothing
    m = scores.max(-1)                               # each chunk's max, per head: -inf for an empty chunk
    p = np.exp(scores - np.where(np.isfinite(m), m, 0)[..., None])
    total, acc = p.sum(-1), np.einsum("shgt,sthd->shgd", p, v)
    # merge: rescale every chunk to the overall max, then one division
    weight = np.exp(m - m.max(0))                    # 0 for empty chunks (m = -inf)
    return (np.einsum("shg,shgd->hgd", weight, acc) / (weight * total).sum(0)[..., None]).astype(np.float32)


def paged_attention(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    lengths: np.ndarray, out: np.ndarray, num_heads: int) -> None:
    """decode_attention, with row b's token t in slot block_tables[b, t // 16] * 16 + t % 16 (chapter 6)."""
    from tinyvllm.block_manager import BLOCK_SIZE
    _, kv_heads, head_dim = k_cache.shape
    for b, length in enumerate(lengths.tolist()):
        t = np.arange(length)
        slots = block_tables[b, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE  # gather through the table
        q = qkv[b, :num_heads * head_dim].reshape(kv_heads, num_heads // kv_heads, head_dim)
        out[b] = attend_in_chunks(q, k_cache[slots], v_cache[slots]).reshape(-1)
