"""Checks shared by the graders: relative error, "float32, finite, right shape, close", and equality
checks whose failure is one line a student can act on: what was checked, expected and got side by side."""
import numpy as np

F32 = np.float32


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def check(out, ref, shape, tol=1e-5, what: str = "the result"):
    """Same shape, float32 (NumPy 2 promotes silently), all finite, and close to the reference."""
    assert isinstance(out, np.ndarray), f"{what}: expected a NumPy array, got {type(out).__name__}"
    assert out.shape == tuple(shape), f"{what}: shape {out.shape}, expected {tuple(shape)}"
    assert out.dtype == np.float32, f"{what}: dtype {out.dtype}, expected float32 (a float64 value leaked in?)"
    bad = ~np.isfinite(out)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {out.size} values are NaN or inf, the first at "
                           f"{[int(i) for i in np.argwhere(bad)[0]]}")
    ref = np.asarray(ref)
    err = rel_err(out, ref)
    if not err < tol:
        worst = np.unravel_index(np.argmax(np.abs(out.astype(np.float64) - ref)), out.shape)
        raise AssertionError(f"{what}: relative error {err:.2e} vs the reference (tolerance {tol:.0e}); the largest "
                             f"difference at {[int(i) for i in worst]}: expected {float(ref[worst]):.6g}, "
                             f"got {float(out[worst]):.6g}")


def show(value, limit: int = 16) -> str:
    """A value as a student reads it: arrays and deques as lists, long lists cut in the middle."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    elif not isinstance(value, (list, tuple, dict, str)) and hasattr(value, "__iter__"):
        value = list(value)  # a deque, a generator of rows
    if isinstance(value, list) and len(value) > limit:
        head = ", ".join(map(repr, value[:limit // 2]))
        tail = ", ".join(map(repr, value[-limit // 4:]))
        return f"[{head}, ..., {tail}] ({len(value)} items)"
    return repr(value)


def same(got, expected, what: str) -> None:
    """got == expected (lists, arrays, deques, dicts, numbers); else AssertionError, one line: what was
    checked, then expected and got, and for two sequences the first index where they differ."""
    g = got.tolist() if isinstance(got, np.ndarray) else got
    e = expected.tolist() if isinstance(expected, np.ndarray) else expected
    if not isinstance(g, (list, tuple, dict, str)) and hasattr(g, "__iter__"):
        g = list(g)
    if isinstance(e, tuple) and isinstance(g, list):
        e = list(e)
    if g == e:
        return
    both = f"expected {show(e)}, got {show(g)}"
    if isinstance(g, list) and isinstance(e, list):  # the first difference first: long lists are cut
        i = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None)
        if i is not None:
            raise AssertionError(f"{what}: at index {i}, expected {e[i]!r}, got {g[i]!r} ({both})")
        raise AssertionError(f"{what}: expected {len(e)} items, got {len(g)} ({both})")
    raise AssertionError(f"{what}: {both}")


def close(got, expected, what: str, rtol: float, atol: float = 0.0) -> None:
    """Element-wise closeness, NaN counted as wrong; else one line: how many differ and the first one."""
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    bad = ~np.isclose(got, expected, rtol=rtol, atol=atol)
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} values differ (rtol {rtol:g}, atol {atol:g}), "
                             f"the first at {list(i)}: expected {expected[i]:.6g}, got {got[i]:.6g}")


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
