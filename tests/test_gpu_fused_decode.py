"""Chapter 8 on the GPU: the fused decode kernels (kernels/fused_decode.cu) against their NumPy twins and against
the unfused kernels they replace, and the fused decode against the unfused one. Run with `make test-gpu`.

- each kernel at T = 1, 3 and 8 rows on Llama 3.2 1B's shapes (hidden 2048 into N 512, 3072, gate_up 2 x 8192 and
  the fp32 lm_head's width class; down's K 8192) and odd ones, outputs NaN-poisoned: within bf16 rounding of its
  twin (relative error < 1e-2, as gemv's tests), and bit for bit what the unfused kernels (add_rms_norm, gemv,
  swiglu, rope, store_kv) produce, since each fused kernel copies their rounding;
- decode of random-weight Llamas (a tiny one, and Llama 3.2 1B's shapes with 2 layers): fused against unfused,
  close logits and the same greedy tokens for 32 steps, both eager, and both through CUDA graphs (whose buckets
  of 1 to 8 rows run the fused layer).
"""
import numpy as np
import pytest

from tests.gpu_helpers import NAN_BF16, bf16_pair, from_bf16, nan_bf16, requires_gpu
from tests.numeric import rel_err
from tinyvllm.model.backend import numpy_ops as twin

pytestmark = [pytest.mark.gpu, requires_gpu]
EPS = 1e-5
ROWS = [1, 3, 8]


@pytest.fixture(scope="module")
def ops():
    from tinyvllm.model.backend import cuda_ops
    return cuda_ops


def poisoned(shape, f32: bool):
    import cupy as cp
    return cp.full(shape, np.nan, cp.float32) if f32 else nan_bf16(shape)


def to_host(a) -> np.ndarray:
    import cupy as cp
    return cp.asnumpy(a) if a.dtype == np.float32 else from_bf16(a)


def same_bits(got, expected, what: str) -> None:
    """Two device arrays with identical bits (NaN where both have the same NaN)."""
    import cupy as cp
    got, expected = cp.asnumpy(got), cp.asnumpy(expected)
    bits = np.uint32 if got.dtype == np.float32 else np.uint16
    differ = np.ascontiguousarray(got).view(bits) != np.ascontiguousarray(expected).view(bits)
    assert not differ.any(), (f"{what}: {int(differ.sum())} of {differ.size} values differ from the unfused kernels', "
                              f"the first at {np.argwhere(differ)[0].tolist()}")


def norm_inputs(rng, T: int, K: int, N: int):
    """residual fp32 (host, device), norm weight and weights as bf16 pairs (float32 for the twin, bits on the GPU)."""
    import cupy as cp
    residual = rng.standard_normal((T, K), dtype=np.float32) * np.float32(3)
    norm32, norm = bf16_pair(rng, (K,))
    w32, w = bf16_pair(rng, (N, K), scale=K ** -0.5)
    return residual, cp.asarray(residual), (norm32, norm), (w32, w)


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("K, N, f32", [(2048, 512, False), (2048, 3072, False), (2048, 50257, True),
                                       (576, 1003, True), (576, 1728, False)])
def test_rms_norm_gemv(ops, rng, T, K, N, f32):
    """out is a column slice of a wider buffer: the kernel writes its columns and nothing else."""
    residual, res, (norm32, norm), (w32, w) = norm_inputs(rng, T, K, N)
    wide = poisoned((T, N + 24), f32)
    ops.rms_norm_gemv(res, norm, w, wide[:, 8:8 + N], EPS)
    got = to_host(wide)
    assert np.isnan(got[:, :8]).all() and np.isnan(got[:, 8 + N:]).all(), "wrote outside its columns"
    expected = np.full((T, N), np.nan, np.float32)
    twin.rms_norm_gemv(residual, norm32, w32, expected, EPS)
    err = rel_err(got[:, 8:8 + N], expected)
    assert err < 1e-2, f"relative error {err:.2e} against the twin"
    np.testing.assert_array_equal(ops.to_host(res), residual, err_msg="the residual is read only")
    normed, unfused = nan_bf16((T, K)), poisoned((T, N), f32)
    ops.add_rms_norm(res, None, norm, normed, EPS)
    ops.gemv(normed, w, unfused)  # the gemv kernel, which the fused ones extend (gemm sends 2+ rows to cuBLAS)
    same_bits(wide[:, 8:8 + N], unfused, "rms_norm_gemv")


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("K, inter", [(2048, 8192), (576, 1536), (256, 100)])
def test_rms_norm_gemv_swiglu(ops, rng, T, K, inter):
    residual, res, (norm32, norm), (w32, w) = norm_inputs(rng, T, K, 2 * inter)
    act = nan_bf16((T, inter))
    ops.rms_norm_gemv_swiglu(res, norm, w, act, EPS)
    expected = np.full((T, inter), np.nan, np.float32)
    twin.rms_norm_gemv_swiglu(residual, norm32, w32, expected, EPS)
    err = rel_err(from_bf16(act), expected)
    assert err < 1e-2, f"relative error {err:.2e} against the twin"
    normed, gate_up, unfused = nan_bf16((T, K)), nan_bf16((T, 2 * inter)), nan_bf16((T, inter))
    ops.add_rms_norm(res, None, norm, normed, EPS)
    ops.gemv(normed, w, gate_up)
    ops.swiglu(gate_up, unfused)
    same_bits(act, unfused, "rms_norm_gemv_swiglu")


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("K, N", [(2048, 2048), (8192, 2048), (1536, 576), (64, 100)])
def test_gemv_add(ops, rng, T, K, N):
    """Every column must be added to: a column left out keeps the old residual and differs from the unfused sum."""
    import cupy as cp
    x32, x = bf16_pair(rng, (T, K))
    w32, w = bf16_pair(rng, (N, K), scale=K ** -0.5)
    residual = rng.standard_normal((T, N), dtype=np.float32) * np.float32(3)
    res = cp.asarray(residual)
    ops.gemv_add(x, w, res)
    expected = residual.copy()
    twin.gemv_add(x32, w32, expected)
    err = rel_err(ops.to_host(res) - residual, expected - residual)
    assert err < 1e-2, f"relative error {err:.2e} of the added delta against the twin"
    delta, unfused, normed = nan_bf16((T, N)), cp.asarray(residual), nan_bf16((T, N))
    ops.gemv(x, w, delta)
    ops.add_rms_norm(unfused, delta, bf16_pair(rng, (N,))[1], normed, EPS)   # its first step: residual += delta
    same_bits(res, unfused, "gemv_add")


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (9, 3, 64), (24, 8, 128), (4, 2, 16)])
def test_rope_store_kv(ops, rng, T, heads, kv_heads, head_dim):
    import cupy as cp
    angles = rng.uniform(0, 4096, (4096, head_dim // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    qkv32, qkv = bf16_pair(rng, (T, (heads + 2 * kv_heads) * head_dim), scale=2.0)
    positions, slots = rng.integers(0, 4096, T).astype(np.int32), rng.choice(50, T, replace=False).astype(np.int32)
    fused = [qkv.copy(), *(cp.full((50, kv_heads, head_dim), NAN_BF16, cp.uint16) for _ in range(2))]
    unfused = [a.copy() for a in fused]
    device = [cp.asarray(a) for a in (positions, cos, sin, slots)]
    ops.rope_store_kv(fused[0], device[0], device[1], device[2], fused[1], fused[2], device[3], heads, kv_heads,
                      head_dim)
    ops.rope(unfused[0], device[0], device[1], device[2], heads + kv_heads, head_dim)
    ops.store_kv(unfused[0], unfused[1], unfused[2], device[3], heads)
    for got, want, what in zip(fused, unfused, ("qkv", "k_cache", "v_cache")):
        same_bits(got, want, f"rope_store_kv's {what}")
    k32, v32 = np.full((2, 50, kv_heads, head_dim), np.nan, np.float32)
    twin.rope_store_kv(qkv32, positions, cos, sin, k32, v32, slots, heads, kv_heads, head_dim)
    assert rel_err(from_bf16(fused[0]), qkv32) < 1e-2
    assert rel_err(from_bf16(fused[1])[slots], k32[slots]) < 1e-2
    np.testing.assert_array_equal(from_bf16(fused[2])[slots], v32[slots])   # V: a copy
    assert np.isnan(from_bf16(fused[1])[np.setdiff1d(np.arange(50), slots)]).all(), "wrote outside its slots"


# ---------------------------------------------------------------- whole decode

@pytest.fixture(scope="module", params=["tiny", "llama-3.2-1b-2-layers"])
def model(request, tmp_path_factory):
    from tests.conftest import TINY_DIMS
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.model import Model
    dims = TINY_DIMS if request.param == "tiny" else dict(num_hidden_layers=2)
    path = synth_model("llama-3.2-1b", tmp_path_factory.mktemp("fused") / "llama", seed=9, **dims)
    return Model(path, device="cuda", max_num_batched_tokens=256)


def greedy(model, prompts: list[list[int]], steps: int, fused: bool, graphs: bool):
    """Prefill the prompts into a fresh pool, then `steps` greedy decode steps; (tokens, logits) per step."""
    import cupy as cp

    from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
    from tinyvllm.model.cuda_graphs import GraphedDecode
    from tinyvllm.model.decode import decode_batch
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.prefill import prefill_batch
    n, num_blocks = len(prompts), len(prompts) * 8
    blocks, pool = BlockManager(num_blocks), PagedKVPool(model.cfg, model.ops, num_blocks)
    model.fused_decode = fused
    try:
        first = prefill_batch(model, pool, [plan_prefill(blocks, s, p) for s, p in enumerate(prompts)])
        graphed = GraphedDecode(model, pool, max_num_seqs=8) if graphs else None
        tokens, history = cp.asnumpy(first.argmax(-1)).tolist(), []
        for _ in range(steps):
            plan = plan_decode(blocks, list(range(n)), tokens)
            logits = cp.asnumpy(graphed(plan) if graphs else decode_batch(model, pool, plan))
            tokens = logits.argmax(-1).tolist()
            history.append((tokens, logits))
        return history
    finally:
        model.fused_decode = True


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("n", [1, 5, 8])
def test_fused_decode_matches_unfused(model, n, graphs, monkeypatch):
    """The fused layer for every row count its kernels take (the engine sends them GEMV_DECODE_ROWS rows at
    most: above that, cuBLAS is faster), against the unfused layer on gemv."""
    from tinyvllm.model import decode
    from tinyvllm.model.backend import cuda_ops
    from tinyvllm.model.backend.constants import GEMV_MAX_ROWS
    monkeypatch.setattr(decode, "GEMV_DECODE_ROWS", GEMV_MAX_ROWS)
    monkeypatch.setattr(cuda_ops, "GEMV_DECODE_ROWS", GEMV_MAX_ROWS)
    assert decode.uses_fused_layer(model, n)
    seed = 40 + n
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, model.cfg.vocab_size, int(rng.integers(1, 60))).tolist() for _ in range(n)]
    fused = greedy(model, prompts, 32, fused=True, graphs=graphs)
    unfused = greedy(model, prompts, 32, fused=False, graphs=graphs)  # a graph pads 5 rows to 8: both alike
    for step, ((tokens, logits), (want_tokens, want_logits)) in enumerate(zip(fused, unfused)):
        assert not np.isnan(logits).any(), f"step {step}: NaN logits (seed {seed})"
        err = rel_err(logits, want_logits)
        assert err < 1e-3, f"step {step}: relative error {err:.2e} against the unfused decode (seed {seed})"
        assert tokens == want_tokens, f"step {step}: greedy tokens {tokens}, unfused {want_tokens} (seed {seed})"
