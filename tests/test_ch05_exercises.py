"""Chapter 5 graders: decode attention in NumPy (anywhere), the decode attention kernel in CUDA C (on a GPU).

Exercise 5.1 is compared with torch's scaled_dot_product_attention (the newest query sees every cached
key) on fresh random caches: sequences at random places among NaN slots, rows in shuffled slot order,
lengths around the kernel's chunk edges and up to 4097, four GQA groupings, scores big enough to
overflow exp() without the max subtracted. Exercise 5.2 is compiled with cupy.RawModule and compared
with the NumPy twin on NaN-poisoned outputs; without a GPU its graders are skipped.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chapters.grading import exercises
from tests.numeric import F32, close, randn, random_cache, rel_err, torch_attention
from tests.test_decode import LENGTHS
from tinyvllm.model.backend import cuda_available

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {  # heads, kv_heads, head_dim
    "mha-d16": (4, 4, 16),            # group 1: every query head has its own K/V head
    "smollm2-gqa3-d64": (9, 3, 64),   # the default model
    "llama1b-gqa4-d64": (32, 8, 64),  # Llama 3.2 1B
    "gqa8-d128": (8, 1, 128),         # all query heads on one K/V head
}


def shuffled_rows(rng, lengths, kv_heads, head_dim, spare=3):
    """random_cache, with the rows permuted: row b's keys may sit before or after row b - 1's."""
    k_cache, v_cache, starts, seqs = random_cache(rng, lengths, kv_heads, head_dim, spare)
    order = rng.permutation(len(seqs))
    return k_cache, v_cache, starts[order], [seqs[i] for i in order]


def new_queries(rng, n, heads, kv_heads, head_dim, scale=2.0):
    """qkv rows whose K and V columns are NaN: decode attention reads only the Q columns."""
    q_cols = heads * head_dim
    qkv = randn(rng, n, q_cols + 2 * kv_heads * head_dim, scale=scale)
    qkv[:, q_cols:] = np.nan
    return qkv


def run(f, qkv, k_cache, v_cache, starts, seqs, heads):
    """Call f into a NaN-filled out with one spare row after the n rows; returns all n + 1 rows."""
    n, q_cols = len(seqs), heads * k_cache.shape[-1]
    lengths = np.array([len(k) for k, _ in seqs], np.int32)
    out = np.full((n + 1, q_cols), np.nan, F32)
    result = f(qkv, k_cache, v_cache, starts, lengths, out[:n], heads)
    assert result is None, "write into `out` in place and return nothing (the engine reads the buffer)"
    return out


def torch_rows(qkv, seqs, heads, head_dim):
    """Each row's query against its own keys, by torch SDPA: the newest position sees every key."""
    return [torch_attention(qkv[b, :heads * head_dim].reshape(1, heads, head_dim), k, v, len(k) - 1)[0]
            for b, (k, v) in enumerate(seqs)]


def check_rows(out, expected, seqs, tol=1e-5):
    n = len(seqs)
    assert np.isnan(out[n]).all(), f"out has {n} rows: something was written into the row after them"
    for b, ((k, _), ref) in enumerate(zip(seqs, expected)):
        assert np.isfinite(out[b]).all(), (f"row {b} ({len(k)} keys): NaN or inf (not written, a slot outside "
                                           "the row's keys read, or exp() overflowed?)")
        err = rel_err(out[b], ref)
        assert err < tol, f"row {b} ({len(k)} keys): relative error {err:.2e} vs torch (tolerance {tol:.0e})"


# ---------- Exercise 5.1: decode attention vs torch's scaled_dot_product_attention ----------

@pytest.mark.ch5
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_attention_matches_torch_sdpa(impl, shape, rng):
    heads, kv_heads, d = SHAPES[shape]
    k_cache, v_cache, starts, seqs = shuffled_rows(rng, LENGTHS, kv_heads, d)
    qkv = new_queries(rng, len(seqs), heads, kv_heads, d)
    out = run(impl("decode_attention"), qkv, k_cache, v_cache, starts, seqs, heads)
    check_rows(out, torch_rows(qkv, seqs, heads, d), seqs)


@pytest.mark.ch5
@pytest.mark.parametrize("shape", ["smollm2-gqa3-d64", "gqa8-d128"])
def test_decode_attention_survives_large_scores(impl, shape, rng):
    """Scores in the hundreds, growing along the sequence: exp() overflows float32 past 88 unless the max
    is subtracted, and a chunk merged without exp(m_c - M) weighs the wrong amount."""
    heads, kv_heads, d = SHAPES[shape]
    k_cache, v_cache, starts, seqs = shuffled_rows(rng, [2, 17, 100, 1000], kv_heads, d)
    for (k, _), start in zip(seqs, starts):
        k *= np.linspace(1, 30, len(k), dtype=F32)[:, None, None]   # later keys: larger scores
        k_cache[start:start + len(k)] = k
    qkv = new_queries(rng, len(seqs), heads, kv_heads, d, scale=4.0)
    out = run(impl("decode_attention"), qkv, k_cache, v_cache, starts, seqs, heads)
    check_rows(out, torch_rows(qkv, seqs, heads, d), seqs, tol=1e-4)


@pytest.mark.ch5
def test_decode_attention_of_one_key_is_its_value(impl, rng):
    """Hand-derived: with one cached key the softmax is 1, so each query head gets its K/V head's v."""
    heads, kv_heads, d = SHAPES["smollm2-gqa3-d64"]
    k_cache, v_cache, starts, seqs = shuffled_rows(rng, [1, 1, 1], kv_heads, d)
    qkv = new_queries(rng, 3, heads, kv_heads, d, scale=10.0)
    out = run(impl("decode_attention"), qkv, k_cache, v_cache, starts, seqs, heads)
    for b, (_, v) in enumerate(seqs):
        expected = v[0][np.arange(heads) // (heads // kv_heads)].reshape(-1)
        close(out[b], expected, f"row {b}, one cached key: each query head's output must be its K/V head's v",
              rtol=1e-6, atol=1e-6)


@pytest.mark.ch5
def test_decode_attention_does_not_depend_on_where_sequences_sit(impl, rng):
    """Hand-derived: the same keys in other slots, rows in another order, give the same rows."""
    heads, kv_heads, d = SHAPES["llama1b-gqa4-d64"]
    lengths = [5, 16, 33, 300]
    k_cache, v_cache, starts, seqs = shuffled_rows(rng, lengths, kv_heads, d, spare=1)
    qkv = new_queries(rng, len(seqs), heads, kv_heads, d)
    f = impl("decode_attention")
    first = run(f, qkv, k_cache, v_cache, starts, seqs, heads)
    # the same sequences again, packed differently: more NaN slots between them, rows reversed
    moved_k = np.full((sum(lengths) + 50 * (len(lengths) + 1), kv_heads, d), np.nan, F32)
    moved_v, moved_starts = moved_k.copy(), []
    start = int(rng.integers(1, 50))
    for k, v in reversed(seqs):
        moved_k[start:start + len(k)], moved_v[start:start + len(k)] = k, v
        moved_starts.append(start)
        start += len(k) + int(rng.integers(1, 50))
    again = run(f, qkv[::-1].copy(), moved_k, moved_v, np.array(moved_starts, np.int32), seqs[::-1], heads)
    check_rows(first, torch_rows(qkv, seqs, heads, d), seqs)
    for b in range(len(seqs)):
        err = rel_err(again[len(seqs) - 1 - b], first[b])
        assert err < 1e-6, f"row {b}: moving its keys to other slots changed the result by {err:.2e}"


# ---------- Exercise 5.2 (GPU): the decode attention kernel in CUDA C vs its NumPy twin ----------

requires_gpu = pytest.mark.skipif(not cuda_available(), reason="Exercise 5.2 is graded on a GPU "
                                  "(needs CuPy and an NVIDIA GPU: pip install -e '.[gpu]')")
# (HEAD_DIM, GROUP) template instances -> kv_heads: Llama 3.2 1B, SmolLM2, plain multi-head at d 128, small heads
KERNEL_INSTANCES = {(64, 4): 8, (64, 3): 3, (128, 1): 4, (32, 2): 4}


@pytest.fixture
def kernel_source(request):
    """kernel_source(name) -> the CUDA C under test: the engine's .cu file, or the student's string."""
    def get(name: str) -> str:
        if request.config.getoption("--impl") == "student":
            return getattr(exercises(5), name)
        return (ROOT / exercises(5).GPU_EXERCISES[name]).read_text()
    return get


def compile_decode_attention(source: str, head_dim: int, group: int):
    """The decode_attention<head_dim, group> instance of the source, compiled as cuda_ops.kernel does."""
    import cupy as cp

    from tinyvllm.model.backend.cuda_ops import NVRTC_OPTIONS  # the engine's include path and -D constants
    name = f"decode_attention<{head_dim}, {group}>"
    module = cp.RawModule(code=source, options=NVRTC_OPTIONS,
                          name_expressions=[name])
    return module.get_function(name)


def bf16_on_gpu(a: np.ndarray):
    """float32 (NaN included) -> (bf16 bits on the GPU, the float32 values those bits hold)."""
    import cupy as cp

    from tinyvllm.formats.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
    bits = float32_to_bf16_bits(a)
    return cp.asarray(bits), bf16_bits_to_float32(bits)


@pytest.mark.ch5
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("head_dim,group", list(KERNEL_INSTANCES))
def test_decode_attention_kernel_source_matches_the_numpy_twin(kernel_source, head_dim, group, rng):
    import cupy as cp

    from tests.gpu_helpers import from_bf16, nan_bf16
    from tinyvllm.model.backend import numpy_ops as twin
    kernel = compile_decode_attention(kernel_source("DECODE_ATTENTION_KERNEL_SOURCE"), head_dim, group)
    kv_heads = KERNEL_INSTANCES[(head_dim, group)]
    heads = kv_heads * group
    k32, v32, starts, seqs = shuffled_rows(rng, LENGTHS, kv_heads, head_dim)   # NaN in every unused slot
    (k_gpu, k32), (v_gpu, v32) = bf16_on_gpu(k32), bf16_on_gpu(v32)
    qkv_gpu, qkv32 = bf16_on_gpu(new_queries(rng, len(seqs), heads, kv_heads, head_dim))
    n, q_cols = len(seqs), heads * head_dim
    lengths = np.array([len(k) for k, _ in seqs], np.int32)
    out = nan_bf16((n + 1, q_cols))  # one spare row: must stay NaN
    kernel((kv_heads, n), (256,), (qkv_gpu, k_gpu, v_gpu, cp.asarray(starts), cp.asarray(lengths), out,
                                   np.int32(kv_heads), np.int32(qkv32.shape[1]), np.int32(q_cols),
                                   np.float32(head_dim ** -0.5)))
    expected = np.empty((n, q_cols), F32)
    twin.decode_attention(qkv32, k32, v32, starts, lengths, expected, heads)
    got = from_bf16(out)
    assert np.isnan(got[n]).all(), "the kernel wrote past row n - 1"
    for b in range(n):
        assert not np.isnan(got[b]).any(), (f"row {b} ({lengths[b]} keys): NaN (not written, or a slot outside "
                                            "its keys read)")
        err = rel_err(got[b], expected[b])
        assert err < 1e-2, f"row {b} ({lengths[b]} keys): relative error {err:.2e} (tolerance 1e-2: bf16 output)"
