"""The NumPy twins (tinyvllm/model/backend/numpy_ops.py) against the independent oracle, tinyvllm/reference.py.

The twins are written from the kernels and no longer borrow the oracle's functions, so on the CPU "engine
against reference" compares two codes; this file checks each twin on its own. Fresh random inputs from the
seeded `rng` (a failure prints the seed), odd sizes included, every output buffer pre-filled with NaN (an
element the twin forgets to write fails) and, where the kernel may be handed a view of a wider buffer, the
columns and rows around it left NaN and checked untouched. float32 throughout: relative error < 1e-5.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.numeric import randn, random_cache, rel_err
from tinyvllm import reference
from tinyvllm.formats.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from tinyvllm.model.backend import constants
from tinyvllm.model.backend import numpy_ops as twin
from tinyvllm.model.step_plan import BLOCK_SIZE

F32 = np.float32
TOL = 1e-5
KERNELS = Path(__file__).resolve().parent.parent / "tinyvllm" / "model" / "kernels"
HEAD_DIMS = [16, 32, 64, 128, 256]  # every head_dim the decode kernels are built for


def nan(*shape) -> np.ndarray:
    return np.full(shape, np.nan, F32)


def assert_close(got, expected, what=""):
    assert got.dtype == F32, f"{what}: dtype {got.dtype} (a float64 leaked in?)"
    assert np.isfinite(got).all(), f"{what}: NaN or inf (an element never written?)"
    err = rel_err(got, expected)
    assert err < TOL, f"{what}: relative error {err:.2e} vs tinyvllm.reference"


# ---------------------------------------------------------------- row kernels

@pytest.mark.parametrize("T,vocab,hidden", [(1, 10, 64), (37, 1000, 577)])
def test_embedding(rng, T, vocab, hidden):
    table, ids = randn(rng, vocab, hidden), rng.integers(0, vocab, T).astype(np.int32)
    residual = nan(T, hidden)
    twin.embedding(ids, table, residual)
    np.testing.assert_array_equal(residual, table[ids])


@pytest.mark.parametrize("T,hidden,scale", [(1, 64, 3.0), (7, 577, 3.0), (33, 1000, 1.0), (3, 3071, 1e-3)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(rng, T, hidden, scale, with_delta):
    """residual += delta in place (fp32), then out = rms_norm(residual) * weight; scale 1e-3: eps matters."""
    residual = randn(rng, T, hidden, scale=scale)
    delta = randn(rng, T, hidden, scale=scale) if with_delta else None
    weight, eps = randn(rng, hidden), float(rng.choice([1e-5, 1e-6]))
    new_residual = residual + delta if with_delta else residual.copy()
    wide = nan(T + 1, hidden + 5)  # out is a view: the row and columns around it must stay NaN
    twin.add_rms_norm(residual, delta, weight, wide[:T, :hidden], eps)
    np.testing.assert_array_equal(residual, new_residual)
    assert_close(wide[:T, :hidden], reference.rms_norm(new_residual, weight, eps), "out")
    assert np.isnan(wide[T]).all() and np.isnan(wide[:, hidden:]).all(), "wrote outside out"


def rope_tables(rng, positions: int, head_dim: int):
    """(positions, head_dim / 2) cos and sin of random frequencies, as model.rope_tables lays them out."""
    inv_freq = (F32(10000.0) ** -(np.arange(0, head_dim, 2, dtype=F32) / F32(head_dim))).astype(F32)
    inv_freq *= rng.uniform(0.5, 1.5, head_dim // 2).astype(F32)  # not just the textbook frequencies
    angles = np.outer(np.arange(positions, dtype=F32), inv_freq)
    return np.cos(angles).astype(F32), np.sin(angles).astype(F32)


@pytest.mark.parametrize("T,heads,kv_heads,head_dim", [(1, 4, 4, 16), (37, 9, 3, 64), (19, 6, 2, 32),
                                                       (5, 8, 2, 128), (3, 4, 1, 256)])
def test_rope(rng, T, heads, kv_heads, head_dim):
    """Q and K heads rotated in place, dim i paired with i + d/2 at row positions[t] of the tables; V and
    anything past the row's qkv columns untouched."""
    cos, sin = rope_tables(rng, 5000, head_dim)
    width, q_cols, kv_cols = (heads + 2 * kv_heads) * head_dim, heads * head_dim, kv_heads * head_dim
    wide = nan(T, width + 8)  # qkv is a view of a wider buffer, as the engine's rows may be
    wide[:, :width] = randn(rng, T, width)
    before = wide[:, :width].copy()
    positions = rng.integers(0, 5000, T).astype(np.int32)
    twin.rope(wide[:, :width], positions, cos, sin, heads + kv_heads, head_dim)

    c, s = np.concatenate([cos[positions]] * 2, -1), np.concatenate([sin[positions]] * 2, -1)  # (T, d)
    for name, cols in [("Q", slice(0, q_cols)), ("K", slice(q_cols, q_cols + kv_cols))]:
        x = before[:, cols].reshape(T, -1, head_dim)
        assert_close(wide[:, cols], reference.apply_rope(x, c, s).reshape(T, -1), name)
    np.testing.assert_array_equal(wide[:, q_cols + kv_cols:width], before[:, q_cols + kv_cols:])  # V
    assert np.isnan(wide[:, width:]).all(), "wrote past the qkv columns"


@pytest.mark.parametrize("T,inter", [(1, 64), (37, 1536), (5, 1001)])
def test_swiglu(rng, T, inter):
    """act = silu(gate) * up from the [gate | up] rows; gates far below -88 (exp overflows) give -0, not NaN."""
    gate_up = randn(rng, T, 2 * inter, scale=3.0)
    gate_up[0, :3] = [-100.0, 100.0, 0.0]
    act = nan(T, inter)
    twin.swiglu(gate_up, act)
    with np.errstate(over="ignore"):
        expected = reference.swiglu(gate_up[:, :inter], gate_up[:, inter:])
    assert_close(act, expected, "act")


def test_argmax_first_of_ties(rng):
    logits = randn(rng, 3, 1001)
    logits[:, [7, 500]] = logits.max() + 1
    out = np.full(3, -1, np.int32)
    twin.argmax(logits, out)
    np.testing.assert_array_equal(out, [7, 7, 7])


@pytest.mark.parametrize("vocab", [1, 7, 1000, 1024, 5003])
def test_sample_rows_draws_the_inverse_cdf_token(rng, vocab):
    """The twin of kernels/sample_rows.cu against an independent inverse CDF (float64 cumsum, searchsorted): the
    same token for every u not within rounding of a boundary; forbidden (-inf) tokens never drawn."""
    rows = 64
    logits = randn(rng, rows, vocab) * 3
    logits[:, rng.random(vocab) < 0.3] = -np.inf
    logits[:, 0] = 1.0   # at least one allowed token per row
    inv_t, u = 1 / rng.uniform(0.2, 2.0, rows), rng.random(rows)
    out = np.full(rows, -1, np.int32)
    twin.sample_rows(logits, inv_t, u, out)
    for r in range(rows):
        p = np.exp((logits[r].astype(np.float64) - logits[r].max()) * inv_t[r])
        cdf = np.cumsum(p) / p.sum()
        if np.min(np.abs(cdf - u[r])) > 1e-9:
            assert out[r] == np.searchsorted(cdf, u[r], side="right"), f"row {r}"
        assert np.isfinite(logits[r, out[r]])


def test_sample_rows_follows_the_softmax(rng):
    """Many rows of one distribution, each with its own u: the drawn tokens' frequencies pass a chi-square test."""
    from tests.test_sampling import chi_square, chi_square_critical
    row = randn(rng, 1, 12) * 1.5
    n = 20000
    out = np.empty(n, np.int32)
    twin.sample_rows(np.repeat(row, n, axis=0), np.full(n, 1 / 0.7), rng.random(n), out)
    p = np.exp((row[0].astype(np.float64) - row.max()) / 0.7)
    assert chi_square(np.bincount(out, minlength=12), p / p.sum()) < chi_square_critical(11)


def test_upload_weight_widens_like_the_checkpoint_loader(rng):
    x = randn(rng, 5, 7)
    bits = float32_to_bf16_bits(x)
    for stored, expected in [(bits, bf16_bits_to_float32(bits)), (x.astype(np.float16), x.astype(np.float16)),
                             (x, x)]:
        got = twin.upload_weight(stored)
        assert got.dtype == F32 and got.shape == x.shape
        np.testing.assert_array_equal(got, expected.astype(F32))


# ---------------------------------------------------------------- attention

@pytest.mark.parametrize("T", [1, 2, 17, 64, 65, 130])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 32), (9, 3, 64), (8, 2, 128)])
def test_prefill_attention(rng, T, heads, kv_heads, head_dim):
    """Causal GQA over the rows of qkv = [Q | K | V], into a view of a wider NaN buffer."""
    q_cols, kv_cols = heads * head_dim, kv_heads * head_dim
    qkv = randn(rng, T, q_cols + 2 * kv_cols, scale=2.0)  # scale 2: peaked softmax rows
    wide = nan(T + 2, q_cols + 16)
    twin.prefill_attention(qkv, wide[:T, :q_cols], heads, kv_heads, head_dim)
    q = qkv[:, :q_cols].reshape(T, heads, head_dim)
    k = qkv[:, q_cols:q_cols + kv_cols].reshape(T, kv_heads, head_dim)
    v = qkv[:, q_cols + kv_cols:].reshape(T, kv_heads, head_dim)
    assert_close(wide[:T, :q_cols], reference.attention(q, k, v, start_pos=0), "out")
    np.testing.assert_allclose(wide[0, :q_cols].reshape(heads, head_dim),
                               v[0, np.arange(heads) // (heads // kv_heads)], rtol=1e-6)  # row 0 sees key 0 only
    assert np.isnan(wide[T:]).all() and np.isnan(wide[:, q_cols:]).all(), "wrote outside out"


def test_store_kv(rng):
    T, heads, kv_heads, d = 7, 6, 2, 32
    q_cols, kv_cols = heads * d, kv_heads * d
    qkv = randn(rng, T, q_cols + 2 * kv_cols)
    k_cache, v_cache = nan(20, kv_heads, d), nan(20, kv_heads, d)
    slots = rng.permutation(20)[:T].astype(np.int32)
    twin.store_kv(qkv, k_cache, v_cache, slots, heads)
    np.testing.assert_array_equal(k_cache[slots].reshape(T, -1), qkv[:, q_cols:q_cols + kv_cols])
    np.testing.assert_array_equal(v_cache[slots].reshape(T, -1), qkv[:, q_cols + kv_cols:])
    others = np.setdiff1d(np.arange(20), slots)
    assert np.isnan(k_cache[others]).all() and np.isnan(v_cache[others]).all()


def kernel_thread_groups(head_dim: int) -> int:
    """decode_attention.cuh's GROUPS, computed here from the shared constants the way the kernel does:
    TPK = HEAD_DIM / BF16_PER_VECTOR threads per key row, GROUPS = DECODE_THREADS / TPK."""
    tpk = head_dim // constants.BF16_PER_VECTOR
    assert tpk <= 32 and 32 % tpk == 0, "the kernel's static_assert: a key row fits in one warp"
    return constants.DECODE_THREADS // tpk


def test_the_kernel_computes_its_chunks_from_the_same_constants():
    """The twin's chunk count is only right while the kernel derives GROUPS from these same macros."""
    source = (KERNELS / "decode_attention.cuh").read_text()
    assert re.search(r"constexpr int TPK = HEAD_DIM / BF16_PER_VECTOR;", source)
    assert re.search(r"constexpr int GROUPS = DECODE_THREADS / TPK;", source)
    assert not re.search(r"(constexpr int|#define) (DECODE_THREADS|BF16_PER_VECTOR)\b", source), \
        "the kernel must take these from -D, not define its own"
    assert {d: constants.decode_thread_groups(d) for d in HEAD_DIMS} == {d: kernel_thread_groups(d) for d in HEAD_DIMS}


def lengths_around(groups: int) -> list[int]:
    """Context lengths that leave chunks empty, fill them exactly, and overflow them by one."""
    return sorted({1, 3, groups - 1, groups, groups + 1, 2 * groups + 5, 301})


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_decode_attention_in_chunks_is_plain_attention(rng, monkeypatch, head_dim, heads, kv_heads):
    """Chunked the kernel's way, merged: the same as softmax over all keys, at every head_dim; and cut into
    exactly the kernel's number of chunks."""
    groups = kernel_thread_groups(head_dim)
    seen, real = [], twin.decode_thread_groups

    def spy(d: int) -> int:  # records how many chunks the twin asks for
        seen.append(real(d))
        return seen[-1]
    monkeypatch.setattr(twin, "decode_thread_groups", spy)

    k_cache, v_cache, starts, seqs = random_cache(rng, lengths_around(groups), kv_heads, head_dim)
    n, q_cols, kv_cols = len(seqs), heads * head_dim, kv_heads * head_dim
    qkv = randn(rng, n, q_cols + 2 * kv_cols, scale=2.0)
    qkv[:, q_cols:] = np.nan  # decode attention reads only the new rows' Q columns
    lengths = np.array([len(k) for k, _ in seqs], np.int32)
    out = nan(n + 1, q_cols)
    twin.decode_attention(qkv, k_cache, v_cache, starts, lengths, out[:n], heads)

    assert seen and set(seen) == {groups}, f"the twin cut contexts into {set(seen)} chunks, the kernel {groups}"
    for b, (k, v) in enumerate(seqs):
        q = qkv[b, :q_cols].reshape(1, heads, head_dim)
        expected = reference.attention(q, k, v, start_pos=len(k) - 1)[0]  # the newest position sees every key
        assert_close(out[b], expected, f"sequence of {len(k)} keys")
        chunked = twin.attend_in_chunks(q[0].reshape(kv_heads, heads // kv_heads, head_dim), k, v, splits=groups)
        np.testing.assert_array_equal(out[b], chunked.reshape(-1))  # the very same sums as groups chunks
    assert np.isnan(out[n]).all(), "wrote past the last row"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (3, 3)])
def test_paged_attention_is_plain_attention(rng, head_dim, heads, kv_heads):
    """Keys gathered through shuffled BLOCK_SIZE-token blocks (tables padded with -1), unused slots NaN."""
    lengths = np.array(sorted({1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, kernel_thread_groups(head_dim) + 3, 200}),
                       np.int32)
    n, max_blocks = len(lengths), -(-int(lengths.max()) // BLOCK_SIZE)
    num_blocks = sum(-(-int(L) // BLOCK_SIZE) for L in lengths) + 4
    k_pool, v_pool = nan(num_blocks * BLOCK_SIZE, kv_heads, head_dim), nan(num_blocks * BLOCK_SIZE, kv_heads, head_dim)
    free = list(rng.permutation(num_blocks))
    tables, seqs = np.full((n, max_blocks), -1, np.int32), []
    for b, L in enumerate(lengths.tolist()):
        k, v = randn(rng, L, kv_heads, head_dim, scale=2.0), randn(rng, L, kv_heads, head_dim)
        for i in range(-(-L // BLOCK_SIZE)):
            tables[b, i] = block = free.pop()
            keys = slice(i * BLOCK_SIZE, min(L, (i + 1) * BLOCK_SIZE))
            k_pool[block * BLOCK_SIZE:block * BLOCK_SIZE + keys.stop - keys.start] = k[keys]
            v_pool[block * BLOCK_SIZE:block * BLOCK_SIZE + keys.stop - keys.start] = v[keys]
        seqs.append((k, v))
    q_cols = heads * head_dim
    qkv = randn(rng, n, q_cols + 2 * kv_heads * head_dim, scale=2.0)
    out = nan(n + 1, q_cols)
    twin.paged_attention(qkv, k_pool, v_pool, tables, lengths, out[:n], heads)
    for b, (k, v) in enumerate(seqs):
        expected = reference.attention(qkv[b, :q_cols].reshape(1, heads, head_dim), k, v, start_pos=len(k) - 1)[0]
        assert_close(out[b], expected, f"sequence of {len(k)} keys")
    assert np.isnan(out[n]).all(), "wrote past the last row"


def test_numpy_ops_does_not_use_the_oracle():
    """The twins are the second code the reference is compared with: they must not call it."""
    assert not hasattr(twin, "reference")
    source = Path(twin.__file__).read_text()
    assert "tinyvllm.reference" not in source and "import reference" not in source
    assert "tinyvllm.model.weights" not in source
