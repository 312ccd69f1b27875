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
