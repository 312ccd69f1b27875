"""Numeric checks shared by the graders: relative error, and "float32, finite, right shape, close"."""
import numpy as np

F32 = np.float32


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def check(out, ref, shape, tol=1e-5):
    """Same shape, float32 (NumPy 2 promotes silently), all finite, and close to the reference."""
    assert isinstance(out, np.ndarray), f"expected a NumPy array, got {type(out).__name__}"
    assert out.shape == tuple(shape), f"shape {out.shape}, expected {tuple(shape)}"
    assert out.dtype == np.float32, f"dtype {out.dtype}, expected float32 (a float64 value leaked in?)"
    assert np.all(np.isfinite(out)), "output has NaN or inf"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.2e} vs the reference (tolerance {tol:.0e})"


def randn(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(F32)


def torch_attention(q, k, v, start_pos):
    """torch SDPA with an explicit causal mask for queries at start_pos.. (its is_causal assumes start 0)."""
    import torch
    T, S = q.shape[0], k.shape[0]
    allowed = torch.arange(S)[None, :] <= (start_pos + torch.arange(T))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q).transpose(0, 1)[None], torch.from_numpy(k).transpose(0, 1)[None],
        torch.from_numpy(v).transpose(0, 1)[None], attn_mask=allowed, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(T, -1).numpy()  # (H, T, d) -> (T, H*d)


def random_cache(rng, lengths, kv_heads, head_dim, spare=3):
    """A NaN-filled (slots, kv_heads, d) K and V with each sequence's keys at a random start; returns
    (k_cache, v_cache, starts, per-sequence (k, v))."""
    total = sum(lengths) + spare * (len(lengths) + 1)
    k_cache = np.full((total, kv_heads, head_dim), np.nan, np.float32)
    v_cache = k_cache.copy()
    starts, start, seqs = [], spare, []
    for n in rng.permutation(lengths):  # sequences in shuffled order: a row's start is not its index
        k, v = randn(rng, n, kv_heads, head_dim, scale=2.0), randn(rng, n, kv_heads, head_dim)
        k_cache[start:start + n], v_cache[start:start + n] = k, v
        starts.append(start)
        seqs.append((k, v))
        start += n + spare
    return k_cache, v_cache, np.array(starts, np.int32), seqs
