"""cuBLAS through the transposition trick against NumPy, for every GEMM shape of a Llama layer."""
import numpy as np
import pytest

from tests.gpu_helpers import bf16_pair, from_bf16, nan_bf16, requires_gpu
from tests.numeric import rel_err
from tinyvllm.formats.checkpoints import PRESETS
from tinyvllm.model.gemm import OP_N, OP_T, gemm_colmajor

pytestmark = [pytest.mark.gpu, requires_gpu]
CFG = PRESETS["llama-3.2-1b"]
H, Q, KV, I, V = CFG.hidden_size, CFG.q_size, CFG.kv_size, CFG.intermediate_size, CFG.vocab_size
LAYER_SHAPES = {"qkv": (Q + 2 * KV, H), "o_proj": (H, Q), "gate_up": (2 * I, H), "down": (H, I)}


@pytest.mark.parametrize("name", LAYER_SHAPES)
@pytest.mark.parametrize("T", [1, 17, 128, 1000])
def test_layer_gemm(name, T):
    from tinyvllm.model.gemm import gemm_cublas
    rng = np.random.default_rng(T)
    N, K = LAYER_SHAPES[name]
    x32, x = bf16_pair(rng, (T, K))
    w32, w = bf16_pair(rng, (N, K), scale=K ** -0.5)
    out = nan_bf16((T, N))
    gemm_cublas(x, w, out)
    assert rel_err(from_bf16(out), x32 @ w32.T) < 1e-2


def test_lm_head_gemm_fp32_out_and_column_slices():
    """fp32 logits out; and an output that is a column slice of a wider buffer (ldc > N)."""
    import cupy as cp

    from tinyvllm.model.gemm import gemm_cublas
    rng = np.random.default_rng(0)
    x32, x = bf16_pair(rng, (3, H))
    w32, w = bf16_pair(rng, (V, H), scale=H ** -0.5)
    logits = cp.full((3, V), np.nan, dtype=cp.float32)
    gemm_cublas(x, w, logits)
    assert rel_err(cp.asnumpy(logits), x32 @ w32.T) < 1e-3
    wide = nan_bf16((5, 3 * 64))
    ws32, ws = bf16_pair(rng, (64, H))
    gemm_cublas(x, ws, wide[:3, 64:128])
    got = from_bf16(wide)
    assert rel_err(got[:3, 64:128], x32 @ ws32.T) < 1e-2
    assert np.isnan(got[:, :64]).all() and np.isnan(got[:, 128:]).all() and np.isnan(got[3:]).all()


def test_emulator_reproduces_cublas_layout():
    """The NumPy column-major emulator, given the same flat buffers and parameters, lays out C as cuBLAS does."""
    import cupy as cp

    from tinyvllm.model.gemm import gemm_cublas
    rng = np.random.default_rng(1)
    T, N, K = 7, 40, 24
    x32, x = bf16_pair(rng, (T, K))
    w32, w = bf16_pair(rng, (N, K))
    out = cp.full((T, N), np.nan, dtype=cp.float32)
    gemm_cublas(x, w, out)
    C = np.full(T * N, np.nan, np.float32)
    gemm_colmajor(OP_T, OP_N, N, T, K, 1.0, w32.ravel(), K, x32.ravel(), K, 0.0, C, N)
    np.testing.assert_allclose(cp.asnumpy(out).ravel(), C, rtol=1e-5, atol=1e-5)
