"""Chapter 8 on the CPU: the fused decode layer (tinyvllm/model/fused.py) gives the unfused layer's bits.

- each fused op's NumPy twin (numpy_ops.rms_norm_gemv, rms_norm_gemv_swiglu, gemv_add, rope_store_kv) against
  the unfused ops it replaces, composed as run_layers composes them, bit for bit, outputs NaN-poisoned; and
  against float64 math written out here, so that a twin and its composition cannot be wrong together;
- whole decode steps of a tiny random Llama, fused against unfused, bit for bit (logits and K/V pool), batch 1 to
  8 — the step buffers NaN-poisoned before every step — and that batch 9 and up, model.fused_decode = False and
  the batch-invariant mode take the unfused layer;
- kernels/fused_decode.cu compiles with nvcc for every instance the engine launches (no GPU needed).
"""
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.numeric import randn, rel_err
from tests.test_kernels_compile import NVCC
from tinyvllm.model.backend import numpy_ops as ops
from tinyvllm.model.backend.constants import GEMV_DECODE_ROWS, GEMV_MAX_ROWS, nvrtc_defines

EPS = 1e-5


def nan(*shape) -> np.ndarray:
    return np.full(shape, np.nan, np.float32)


def same_bits(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype == np.float32, what
    assert np.isfinite(expected).all(), f"{what}: the unfused reference is not finite"
    differ = got.view(np.uint32) != expected.view(np.uint32)
    if differ.any():
        i = tuple(int(j) for j in np.argwhere(differ)[0])
        raise AssertionError(f"{what}: {int(differ.sum())} of {differ.size} values differ in their bits, the first at "
                             f"{list(i)}: unfused {expected[i]!r}, fused {got[i]!r}")


def normalized64(residual: np.ndarray, weight: np.ndarray) -> np.ndarray:
    x = residual.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * weight


def layer_inputs(rng, T: int, K: int, N: int):
    residual = randn(rng, T, K, scale=3.0)
    norm_weight = (1 + 0.1 * rng.standard_normal(K)).astype(np.float32)
    return residual, norm_weight, randn(rng, N, K, scale=K ** -0.5)


@pytest.mark.parametrize("T", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("K, N", [(64, 128), (576, 1728), (2048, 512)])
def test_rms_norm_gemv_is_add_rms_norm_then_gemm(rng, T, K, N):
    residual, norm_weight, w = layer_inputs(rng, T, K, N)
    kept, out = residual.copy(), nan(T, N)
    ops.rms_norm_gemv(residual, norm_weight, w, out, EPS)
    normed, expected = nan(T, K), nan(T, N)
    ops.add_rms_norm(kept.copy(), None, norm_weight, normed, EPS)   # as run_layers: the norm, then the projection
    ops.gemm(normed, w, expected)
    same_bits(out, expected, "rms_norm_gemv")
    same_bits(residual, kept, "the residual (read only)")
    assert rel_err(out, normalized64(kept, norm_weight) @ w.T) < 1e-5


@pytest.mark.parametrize("T", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("K, inter", [(64, 128), (576, 1536)])
def test_rms_norm_gemv_swiglu_is_norm_gemm_swiglu(rng, T, K, inter):
    residual, norm_weight, w_gate_up = layer_inputs(rng, T, K, 2 * inter)
    act = nan(T, inter)
    ops.rms_norm_gemv_swiglu(residual, norm_weight, w_gate_up, act, EPS)
    normed, gate_up, expected = nan(T, K), nan(T, 2 * inter), nan(T, inter)
    ops.add_rms_norm(residual.copy(), None, norm_weight, normed, EPS)
    ops.gemm(normed, w_gate_up, gate_up)
    ops.swiglu(gate_up, expected)
    same_bits(act, expected, "rms_norm_gemv_swiglu")
    h = normalized64(residual, norm_weight) @ w_gate_up.T.astype(np.float64)
    gate, up = h[:, :inter], h[:, inter:]
    assert rel_err(act, gate / (1 + np.exp(-gate)) * up) < 1e-5


@pytest.mark.parametrize("T", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("K, N", [(128, 64), (1536, 576), (8192, 2048)])
def test_gemv_add_is_gemm_then_the_residual_add(rng, T, K, N):
    x, w, residual = randn(rng, T, K), randn(rng, N, K, scale=K ** -0.5), randn(rng, T, N, scale=3.0)
    before = residual.copy()
    ops.gemv_add(x, w, residual)
    delta, expected = nan(T, N), before.copy()
    ops.gemm(x, w, delta)
    expected += delta                      # what the next add_rms_norm does first
    same_bits(residual, expected, "gemv_add")
    assert rel_err(residual - before, x.astype(np.float64) @ w.T) < 1e-5


@pytest.mark.parametrize("T", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (32, 8, 64)])
def test_rope_store_kv_is_rope_then_store_kv(rng, T, heads, kv_heads, head_dim):
    angles = rng.uniform(0, 4096, (4096, head_dim // 2))    # a table row per position, as model.rope_tables
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    qkv = randn(rng, T, (heads + 2 * kv_heads) * head_dim)
    positions = rng.integers(0, 4096, T).astype(np.int32)
    slots = rng.choice(50, T, replace=False).astype(np.int32)
    k_cache, v_cache = nan(50, kv_heads, head_dim), nan(50, kv_heads, head_dim)   # NaN where no slot is written
    expected = [qkv.copy(), k_cache.copy(), v_cache.copy()]
    ops.rope_store_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads, head_dim)
    ops.rope(expected[0], positions, cos, sin, heads + kv_heads, head_dim)
    ops.store_kv(expected[0], expected[1], expected[2], slots, heads)
    for got, want, what in zip((qkv, k_cache, v_cache), expected, ("qkv", "k_cache", "v_cache")):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=what)
    assert np.isnan(k_cache[np.setdiff1d(np.arange(50), slots)]).all()
    assert not np.isnan(k_cache[slots]).any() and not np.isnan(v_cache[slots]).any()


# ---------------------------------------------------------------- whole decode steps

@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from tinyvllm.model.model import Model
    return Model(tiny_llama_dir, device="cpu", max_num_batched_tokens=256)


def op_names(model, step) -> set[str]:
    """The backend ops one call of step() runs on the model."""
    from tinyvllm.model.op_timer import timed_ops
    with timed_ops(model) as timer:
        step()
    return {name for name, _ in timer.seconds()}


def poison(model) -> None:
    """NaN in every step buffer: a fused op that reads a row nobody wrote this step turns the logits to NaN."""
    for buf in model.buffers.values():
        buf[...] = np.nan


def decode_both_ways(model, rng, n: int, steps: int = 3):
    """n sequences prefilled alike into two pools, then `steps` decode steps on each: fused and unfused.
    Yields (fused logits, unfused logits, fused pool, unfused pool, op names of the fused-mode step)."""
    from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
    from tinyvllm.model.decode import decode_batch
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.prefill import prefill_batch
    longest = min(40, model.max_num_batched_tokens // n)   # the n prompts are prefilled in one step
    prompts = [rng.integers(0, model.cfg.vocab_size, int(rng.integers(1, longest + 1))).tolist() for _ in range(n)]
    runs = []
    for _ in range(2):
        blocks = BlockManager(n * 8)
        pool = PagedKVPool(model.cfg, model.ops, n * 8)
        prefill_batch(model, pool, [plan_prefill(blocks, s, p) for s, p in enumerate(prompts)])
        runs.append((blocks, pool))
    try:
        for _ in range(steps):
            tokens = rng.integers(0, model.cfg.vocab_size, n).tolist()
            logits, names = [], None
            for fused, (blocks, pool) in zip((True, False), runs):
                model.fused_decode = fused
                plan = plan_decode(blocks, list(range(n)), tokens)
                poison(model)
                if fused:
                    names = op_names(model, lambda: logits.append(decode_batch(model, pool, plan)))
                else:
                    logits.append(decode_batch(model, pool, plan))
            yield logits[0], logits[1], runs[0][1], runs[1][1], names
    finally:
        model.fused_decode = True


@pytest.mark.parametrize("n", range(1, GEMV_MAX_ROWS + 1))
def test_fused_decode_gives_the_unfused_bits(model, rng, n, monkeypatch):
    """Every row count the fused kernels take, not only the GEMV_DECODE_ROWS the engine sends them."""
    from tinyvllm.model import decode
    monkeypatch.setattr(decode, "GEMV_DECODE_ROWS", GEMV_MAX_ROWS)
    for step, (fused, unfused, fused_pool, unfused_pool, names) in enumerate(decode_both_ways(model, rng, n)):
        assert {"rms_norm_gemv", "gemv_add"} <= names and not names & {"gemm", "add_rms_norm"}, names
        same_bits(fused, unfused, f"the logits of {n} sequences at step {step}")
        same_bits(fused_pool.k, unfused_pool.k, "the K pool")
        same_bits(fused_pool.v, unfused_pool.v, "the V pool")


@pytest.mark.parametrize("n", [GEMV_DECODE_ROWS + 1, GEMV_MAX_ROWS + 1, 13])
def test_more_rows_than_gemv_takes_the_unfused_layer(model, rng, n):
    for fused, unfused, _, _, names in decode_both_ways(model, rng, n, steps=1):
        assert "gemm" in names and not names & {"rms_norm_gemv", "gemv_add"}, names
        same_bits(fused, unfused, f"the logits of {n} sequences")


def test_the_switches_keep_the_unfused_layer(model, rng):
    """model.fused_decode = False and the batch-invariant mode (whose ops withhold the fused kernels) run
    run_layers; the contiguous cache's decode_step (decode_attention) runs fused by default."""
    from tinyvllm.model.batch_invariant import BatchInvariantOps
    from tinyvllm.model.decode import decode_step, uses_fused_layer
    from tinyvllm.model.kv_pool import ContiguousKVCache
    from tinyvllm.model.prefill import prefill
    assert uses_fused_layer(model, 1) and not uses_fused_layer(model, GEMV_DECODE_ROWS + 1)
    ids = rng.integers(0, model.cfg.vocab_size, 20).tolist()
    cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=32)
    prefill(model, ids, cache=cache)
    assert "rms_norm_gemv" in op_names(model, lambda: decode_step(model, [ids[-1]], cache, [0]))
    original = model.ops
    try:
        model.fused_decode = False
        assert not uses_fused_layer(model, 1)
        assert "gemm" in op_names(model, lambda: decode_step(model, [ids[-1]], cache, [0]))
        model.fused_decode, model.ops = True, BatchInvariantOps(original)
        assert not uses_fused_layer(model, 1) and not hasattr(model.ops, "rms_norm_gemv")
        assert "gemm" in op_names(model, lambda: decode_step(model, [ids[-1]], cache, [0]))
    finally:
        model.fused_decode, model.ops = True, original


# ---------------------------------------------------------------- the kernels compile

KERNEL = Path(__file__).resolve().parent.parent / "tinyvllm" / "model" / "kernels" / "fused_decode.cu"
INSTANCES = ([f"template __global__ void rms_norm_gemv<{n}, {f}>(const float*, const __nv_bfloat16*, "
              f"const __nv_bfloat16*, void*, float, int, int, int);\n" for n in range(1, 9) for f in ("true", "false")]
             + [f"template __global__ void rms_norm_gemv_swiglu<{n}>(const float*, const __nv_bfloat16*, "
                f"const __nv_bfloat16*, __nv_bfloat16*, float, int, int);\n" for n in range(1, 9)]
             + [f"template __global__ void gemv_add<{n}>(const __nv_bfloat16*, const __nv_bfloat16*, float*, int, "
                f"int);\n" for n in range(1, 9)])


@pytest.mark.slow   # nvcc, seconds a kernel
@pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile-check kernels)")
def test_fused_kernels_compile_for_sm90_without_spilling(tmp_path):
    """Every (rows, output type) instance compiles, and none spills registers to local memory: the kernels'
    __launch_bounds__ ask for FUSED_BLOCKS_PER_SM blocks per SM, which caps each thread's registers."""
    source = tmp_path / KERNEL.name
    source.write_text(f'#include "{KERNEL}"\n' + "".join(INSTANCES))
    run = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", f"-I{KERNEL.parent}", *nvrtc_defines(), "-Xptxas", "-v",
                          "-c", str(source), "-o", str(tmp_path / "k.o")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    spills = [line for line in run.stderr.splitlines() if "spill" in line and " 0 bytes spill stores" not in line]
    assert not spills, "\n".join(spills)

