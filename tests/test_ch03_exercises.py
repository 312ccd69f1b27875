"""Chapter 3 graders: online-softmax attention in NumPy (anywhere), the RMSNorm kernel in CUDA C (on a GPU).

Exercise 3.1 is compared with torch's scaled_dot_product_attention under an explicit causal mask, on
fresh random inputs with odd sizes, several tile sizes, queries that start past position 0, and grouped
K/V heads. Exercise 3.2 is compiled with cupy.RawModule and compared with the kernel's NumPy twin on
NaN-filled outputs; without a GPU its graders are skipped.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from chapters.grading import exercises
from tinyvllm.model.backend import cuda_available

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
from tests.numeric import F32, check, close, randn, rel_err, torch_attention  # noqa: E402,F401

# ---------- Exercise 3.1: online-softmax attention vs torch's scaled_dot_product_attention ----------

CASES = {  # T, S, start_pos, H, KVH, d
    "prefill-gqa3": (37, 37, 0, 9, 3, 64),     # the chapter's prompt with SmolLM2's heads
    "prefill-mqa": (23, 23, 0, 8, 1, 24),      # every query head on one K/V head
    "chunk-after-cache": (13, 50, 37, 8, 2, 16),  # 13 new tokens after 37 cached ones
    "decode-step": (1, 29, 28, 6, 3, 32),      # one query reading a 29-token cache
}


@pytest.mark.ch3
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("block", [1, 5, 16, 64])
def test_online_softmax_attention_matches_torch_sdpa(impl, case, block, rng):
    T, S, start, H, KVH, d = CASES[case]
    q, k, v = randn(rng, T, H, d, scale=2.0), randn(rng, S, KVH, d, scale=2.0), randn(rng, S, KVH, d)
    check(impl("online_softmax_attention")(q, k, v, start, block), torch_attention(q, k, v, start), (T, H * d),
          what=f"T={T} queries from position {start}, S={S} keys, {H} heads on {KVH} K/V heads, tiles of {block}")


@pytest.mark.ch3
def test_online_softmax_attention_rescales_when_the_max_grows(impl, rng):
    """Scores in the hundreds that rise from tile to tile: without the max subtracted exp() overflows,
    and without rescaling the old sums by exp(m_old - m_new) the early tiles weigh far too much."""
    T, H, KVH, d, block = 29, 4, 2, 16, 6
    q = randn(rng, T, H, d)
    k = randn(rng, T, KVH, d) * np.linspace(1, 60, T, dtype=F32)[:, None, None]  # later keys: larger scores
    v = randn(rng, T, KVH, d)
    ref = torch_attention(q, k, v, 0)
    check(impl("online_softmax_attention")(q, k, v, 0, block), ref, (T, H * d), tol=1e-4,
          what="scores growing from tile to tile (tiles of 6)")


@pytest.mark.ch3
@pytest.mark.parametrize("block", [5, 32])
def test_online_softmax_attention_with_every_score_far_below_zero(impl, block, rng):
    """Queries and keys pointing opposite ways: every score is around -1600, so exp(score) is 0 in float32.
    Softmax does not care where the scores sit; a running max that starts at 0 instead of -inf does: it
    stays 0, every exp(score - m) underflows, and the output is 0 / 0."""
    T, H, KVH, d = 21, 4, 2, 16
    q = np.full((T, H, d), 20.0, F32) + randn(rng, T, H, d, scale=0.5)
    k = np.full((T, KVH, d), -20.0, F32) + randn(rng, T, KVH, d, scale=0.5)
    v = randn(rng, T, KVH, d)
    check(impl("online_softmax_attention")(q, k, v, 0, block), torch_attention(q, k, v, 0), (T, H * d), tol=1e-4,
          what=f"scores all far below zero (around -1600), tiles of {block}")


@pytest.mark.ch3
@pytest.mark.parametrize("block", [4, 7])
def test_online_softmax_attention_survives_rows_with_no_visible_key_in_a_tile(impl, block, rng):
    """Query 0 sees only key 0: every later tile is all -inf for it, and exp(-inf - -inf) would be NaN.
    Its output must be exactly v[0] of its K/V head."""
    T, H, KVH, d = 19, 6, 2, 8
    q, k, v = randn(rng, T, H, d, scale=3.0), randn(rng, T, KVH, d, scale=3.0), randn(rng, T, KVH, d)
    out = impl("online_softmax_attention")(q, k, v, 0, block)
    check(out, torch_attention(q, k, v, 0), (T, H * d), what=f"tiles of {block}, where query 0 sees no key after "
          "the first tile")
    close(out[0].reshape(H, d), v[0][np.arange(H) // (H // KVH)], "query 0 (it sees only key 0): its output must be "
          "v[0] of its K/V head", rtol=1e-5, atol=1e-6)


@pytest.mark.ch3
@pytest.mark.parametrize("block", [3, 8, 32])
def test_online_softmax_attention_never_reads_keys_after_the_last_query(impl, block, rng):
    """K and V hold 40 positions, the queries end at position 14: keys 15.. are NaN and must not be read."""
    T, S, start, H, KVH, d = 5, 40, 10, 4, 4, 8
    q, k, v = randn(rng, T, H, d), randn(rng, S, KVH, d), randn(rng, S, KVH, d)
    ref = torch_attention(q, k[:start + T], v[:start + T], start)
    k[start + T:], v[start + T:] = np.nan, np.nan
    check(impl("online_softmax_attention")(q, k, v, start, block), ref, (T, H * d),
          what=f"keys {start + T}.. are NaN (after the last query, never to be read), tiles of {block}")


@pytest.mark.ch3
def test_online_softmax_attention_does_not_depend_on_the_tile_size(impl, rng):
    """Hand-derived: the tiles change the order of the sums, not the result."""
    T, H, KVH, d = 31, 4, 2, 16
    q, k, v = randn(rng, T, H, d, scale=2.0), randn(rng, T, KVH, d, scale=2.0), randn(rng, T, KVH, d)
    f = impl("online_softmax_attention")
    one_tile = f(q, k, v, 0, T)
    for block in (2, 9, 30):
        check(f(q, k, v, 0, block), one_tile, (T, H * d), what=f"tiles of {block} against one tile of all {T} keys")


# ---------- Exercise 3.2 (GPU): the add_rms_norm kernel in CUDA C vs its NumPy twin ----------

requires_gpu = pytest.mark.skipif(not cuda_available(), reason="Exercise 3.2 is graded on a GPU "
                                  "(needs CuPy and an NVIDIA GPU: pip install -e '.[gpu]')")


@pytest.fixture
def kernel_source(request):
    """kernel_source(name) -> the CUDA C under test: the engine's .cu file, or the student's string."""
    def get(name: str) -> str:
        if request.config.getoption("--impl") == "student":
            return getattr(exercises(3), name)
        return (ROOT / exercises(3).GPU_EXERCISES[name]).read_text()
    return get


def compile_add_rms_norm(source: str):
    import cupy as cp

    from tinyvllm.model.backend.cuda_ops import NVRTC_OPTIONS  # the engine's include path and -D constants
    module = cp.RawModule(code=source, options=NVRTC_OPTIONS)
    return module.get_function("add_rms_norm")


@pytest.mark.ch3
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("T,hidden,scale", [(1, 64, 3.0), (5, 576, 3.0), (37, 1000, 3.0), (129, 2048, 3.0),
                                             (3, 3071, 1e-3)])  # 1e-3: eps dominates the mean square
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_kernel_source_matches_the_numpy_twin(kernel_source, T, hidden, with_delta, scale, rng):
    import cupy as cp

    from tests.gpu_helpers import bf16_pair, from_bf16, nan_bf16
    from tinyvllm.model.backend import numpy_ops as twin
    kernel = compile_add_rms_norm(kernel_source("RMS_NORM_KERNEL_SOURCE"))
    residual = rng.standard_normal((T, hidden), dtype=F32) * F32(scale)
    delta32, delta = bf16_pair(rng, (T, hidden), scale=scale) if with_delta else (None, None)
    weight32, weight = bf16_pair(rng, (hidden,))
    res_gpu, out = cp.asarray(residual), nan_bf16((T + 2, hidden))  # 2 extra rows: must stay NaN
    eps = float(rng.choice([1e-5, 1e-6]))
    kernel((T,), (256,), (res_gpu, delta if with_delta else np.uint64(0), weight, out, F32(eps), np.int32(hidden)))
    expected = np.empty((T, hidden), F32)
    twin.add_rms_norm(residual, delta32, weight32, expected, eps)  # updates `residual` in place, too
    got = from_bf16(out)
    assert not np.isnan(got[:T]).any(), "some outputs were never written (still NaN)"
    assert np.isnan(got[T:]).all(), "the kernel wrote past row T - 1"
    close(cp.asnumpy(res_gpu), residual, "the residual after the kernel: it must become residual + delta, in fp32",
          rtol=1e-6, atol=1e-6 * scale)
    err = rel_err(got[:T], expected)
    assert err < 1e-2, f"relative error {err:.2e} vs numpy_ops.add_rms_norm (tolerance 1e-2: bf16 output)"
