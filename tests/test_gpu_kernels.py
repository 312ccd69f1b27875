"""Every CUDA kernel against its NumPy twin (tinyvllm/model/backend/numpy_ops.py) on fresh random inputs,
odd sizes included, outputs filled with NaN before the launch; and every kernel file that takes a launch
constant from Python (backend/constants.py, through -D) refuses to compile without it. Run with `make test-gpu`."""
import re
from pathlib import Path

import numpy as np
import pytest

from tests.gpu_helpers import bf16_pair, from_bf16, nan_bf16, requires_gpu
from tests.numeric import rel_err
from tinyvllm.formats.checkpoints import PRESETS
from tinyvllm.model.backend import numpy_ops as twin
from tinyvllm.model.model import rope_tables

pytestmark = [pytest.mark.gpu, requires_gpu]

KERNELS_DIR = Path(__file__).resolve().parent.parent / "tinyvllm" / "model" / "kernels"
# kernel file -> the constants it insists on (its `#ifndef NAME / #error` guards, its headers' included)
def guards(path, seen: set | None = None) -> set[str]:
    """The constants a kernel file stops without (#ifndef NAME / #error), its own and its local includes'."""
    seen = set() if seen is None else seen
    seen.add(path.name)
    text = path.read_text()
    names = set(re.findall(r"#ifndef (\w+)\n#error", text))
    for included in re.findall(r'#include "([\w.]+)"', text):
        if included not in seen:
            names |= guards(KERNELS_DIR / included, seen)
    return names


GUARDED = {path.stem: guards(path) for path in sorted(KERNELS_DIR.glob("*.cu"))}


@pytest.fixture(scope="module")
def ops():
    from tinyvllm.model.backend import cuda_ops
    return cuda_ops


@pytest.mark.parametrize("T,vocab,hidden", [(1, 1000, 64), (37, 49152, 576), (130, 5000, 2049)])
def test_embedding(ops, rng, T, vocab, hidden):
    import cupy as cp
    table32, table = bf16_pair(rng, (vocab, hidden))
    ids = rng.integers(0, vocab, T).astype(np.int32)
    out = cp.full((T, hidden), np.nan, dtype=cp.float32)
    ops.embedding(cp.asarray(ids), table, out)
    expected = np.empty((T, hidden), np.float32)
    twin.embedding(ids, table32, expected)
    np.testing.assert_array_equal(cp.asnumpy(out), expected)


@pytest.mark.parametrize("T,hidden", [(1, 64), (5, 576), (37, 1000), (129, 2048), (3, 3072)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(ops, rng, T, hidden, with_delta):
    import cupy as cp
    residual = rng.standard_normal((T, hidden), dtype=np.float32) * 3
    delta32, delta = bf16_pair(rng, (T, hidden)) if with_delta else (None, None)
    weight32, weight = bf16_pair(rng, (hidden,))
    res_gpu, out = cp.asarray(residual), nan_bf16((T, hidden))
    ops.add_rms_norm(res_gpu, delta, weight, out, 1e-5)
    expected_out = np.empty((T, hidden), np.float32)
    twin.add_rms_norm(residual, delta32, weight32, expected_out, 1e-5)
    np.testing.assert_allclose(cp.asnumpy(res_gpu), residual, rtol=1e-6, atol=1e-6)
    assert rel_err(from_bf16(out), expected_out) < 1e-2


@pytest.mark.parametrize("T,heads,kv_heads,head_dim", [(1, 4, 4, 64), (37, 9, 3, 64), (200, 32, 8, 64),
                                                        (17, 24, 8, 128)])
def test_rope(ops, rng, T, heads, kv_heads, head_dim):
    from dataclasses import replace

    import cupy as cp
    cfg = replace(PRESETS["llama-3.2-1b"], head_dim=head_dim)  # llama3 frequency scaling
    cos, sin = rope_tables(cfg, 9000)
    width = (heads + 2 * kv_heads) * head_dim
    qkv32, qkv = bf16_pair(rng, (T, width))
    positions = rng.integers(0, 9000, T).astype(np.int32)
    ops.rope(qkv, cp.asarray(positions), cp.asarray(cos), cp.asarray(sin), heads + kv_heads, head_dim)
    twin.rope(qkv32, positions, cos, sin, heads + kv_heads, head_dim)
    got = from_bf16(qkv)
    assert rel_err(got, qkv32) < 1e-2
    v = slice((heads + kv_heads) * head_dim, None)
    np.testing.assert_array_equal(got[:, v], qkv32[:, v])  # V columns are not rotated


@pytest.mark.parametrize("T", [1, 15, 16, 17, 64, 65, 200, 1000])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (32, 8, 64), (8, 2, 128), (4, 2, 16),
                                                     (6, 2, 32)])
def test_prefill_attention(ops, rng, T, heads, kv_heads, head_dim):
    width = (heads + 2 * kv_heads) * head_dim
    qkv32, qkv = bf16_pair(rng, (T, width), scale=2.0)  # scale 2: peaked softmax rows, not uniform mush
    out = nan_bf16((T, heads * head_dim))
    ops.prefill_attention(qkv, out, heads, kv_heads, head_dim)
    expected = np.empty((T, heads * head_dim), np.float32)
    twin.prefill_attention(qkv32, expected, heads, kv_heads, head_dim)
    got = from_bf16(out)
    assert not np.isnan(got).any()
    assert rel_err(got, expected) < 1e-2
    np.testing.assert_allclose(got[0], expected[0], rtol=2e-2, atol=2e-2)  # row 0 sees only key 0: = v_0


@pytest.mark.parametrize("start,T", [(1, 1), (15, 17), (16, 64), (17, 65), (100, 200), (1000, 37), (4000, 130)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 64), (8, 2, 128), (4, 2, 16)])
def test_chunk_attention(ops, rng, start, T, heads, kv_heads, head_dim):
    """A chunk at positions start .. start + T - 1 against its sequence's keys in a NaN-filled pool, found
    through a shuffled block table: a slot read that is not the sequence's poisons the output."""
    import cupy as cp

    from tinyvllm.formats.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
    from tinyvllm.model.step_plan import BLOCK_SIZE
    num_blocks = -(-(start + T) // BLOCK_SIZE)
    table = rng.permutation(3 * num_blocks)[:num_blocks].astype(np.int32)     # spread over a bigger pool
    pool_bits = np.full((3 * num_blocks * BLOCK_SIZE, kv_heads, head_dim), 0x7FC0, np.uint16)  # bf16 NaN
    t = np.arange(start + T)
    slots = table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    k_bits, v_bits = pool_bits.copy(), pool_bits.copy()
    for bits in (k_bits, v_bits):
        bits[slots] = float32_to_bf16_bits(rng.standard_normal((start + T, kv_heads, head_dim), np.float32) * 2)
    qkv32, qkv = bf16_pair(rng, (T, (heads + 2 * kv_heads) * head_dim), scale=2.0)
    out = nan_bf16((T, heads * head_dim))
    ops.chunk_attention(qkv, cp.asarray(k_bits), cp.asarray(v_bits), cp.asarray(table), start, out, heads)
    expected = np.empty((T, heads * head_dim), np.float32)
    twin.chunk_attention(qkv32, bf16_bits_to_float32(k_bits), bf16_bits_to_float32(v_bits), table, start, expected,
                         heads)
    got = from_bf16(out)
    assert not np.isnan(got).any() and not np.isnan(expected).any()
    assert rel_err(got, expected) < 1e-2


def test_prefill_attention_writes_only_its_columns(ops, rng):
    """out may be a slice of a wider buffer: the kernel writes its rows' head columns and nothing else."""
    import cupy as cp
    T, heads, kv_heads, d = 33, 4, 2, 64
    _, qkv = bf16_pair(rng, (T, (heads + 2 * kv_heads) * d))
    wide = nan_bf16((T + 3, heads * d + 64))
    ops.prefill_attention(qkv, wide[:T, :heads * d], heads, kv_heads, d)
    got = from_bf16(wide)
    assert not np.isnan(got[:T, :heads * d]).any()
    assert np.isnan(got[T:]).all() and np.isnan(got[:, heads * d:]).all()
    assert cp.asnumpy(wide).dtype == np.uint16


@pytest.mark.parametrize("T,inter", [(1, 64), (37, 1536), (5, 1000), (3, 100), (129, 8192)])
def test_swiglu(ops, rng, T, inter):
    gate_up32, gate_up = bf16_pair(rng, (T, 2 * inter))
    act = nan_bf16((T, inter))
    ops.swiglu(gate_up, act)
    expected = np.empty((T, inter), np.float32)
    twin.swiglu(gate_up32, expected)
    assert rel_err(from_bf16(act), expected) < 1e-2


@pytest.mark.parametrize("rows,vocab", [(1, 1000), (3, 49152), (2, 128256), (64, 128256), (4, 1), (5, 1025)])
def test_argmax(ops, rng, rows, vocab):
    """kernels/argmax.cu against NumPy's argmax and the twin: ties (the first index wins), NaNs (the first NaN wins),
    an all -inf row, the maximum in the last, short piece, and rows read through a stride."""
    import cupy as cp
    wide = rng.standard_normal((rows, vocab + 3), dtype=np.float32)
    logits = wide[:, :vocab]   # rows 3 floats apart
    if vocab > 10:
        top = logits.max(axis=1) + 1
        logits[:, vocab // 2] = top
        logits[:, vocab - 1] = top
        logits[-1] = -np.inf
        logits[0, rng.integers(0, vocab, 2)] = np.nan
        logits[min(1, rows - 1), vocab - 1] = 1e30
    out, twin_out = cp.full(rows, -1, dtype=cp.int32), np.full(rows, -1, np.int32)
    ops.argmax(cp.asarray(wide)[:, :vocab], out)
    twin.argmax(logits, twin_out)
    np.testing.assert_array_equal(cp.asnumpy(out), np.argmax(logits, axis=1))
    np.testing.assert_array_equal(twin_out, np.argmax(logits, axis=1))


@pytest.mark.parametrize("rows,vocab", [(1, 1), (5, 1000), (64, 49152), (16, 128256)])
def test_sample_rows_matches_its_twin_and_ignores_its_neighbours(ops, rng, rows, vocab):
    """kernels/sample_rows.cu against numpy_ops.sample_rows (the same sums in the same order: the same tokens),
    with forbidden tokens and an all-forbidden row; then each row drawn alone gives the token it got among 256
    shuffled rows (the batch-invariant mode's claim), where CuPy's batched softmax path is not asked to."""
    import cupy as cp

    from tinyvllm.model.backend import numpy_ops
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * 4
    logits[:, rng.random(vocab) < 0.2] = -np.inf
    logits[:, 0] = 0.5
    if rows > 1:
        logits[-1] = -np.inf
    inv_t, u = 1 / rng.uniform(0.3, 2.0, rows), rng.random(rows)
    expected = np.full(rows, -1, np.int32)
    numpy_ops.sample_rows(logits, inv_t, u, expected)
    out = cp.full(rows, -1, cp.int32)
    ops.sample_rows(cp.asarray(logits), cp.asarray(inv_t), cp.asarray(u), out)
    np.testing.assert_array_equal(cp.asnumpy(out), expected)
    order = rng.permutation(256) % rows
    many = cp.full(256, -1, cp.int32)
    ops.sample_rows(cp.asarray(logits[order]), cp.asarray(inv_t[order]), cp.asarray(u[order]), many)
    np.testing.assert_array_equal(cp.asnumpy(many), expected[order])


def test_the_guarded_kernels():
    """The files whose code uses a constant from Python (the rest read their launch shape from blockDim)."""
    assert {name for name, needs in GUARDED.items() if needs} == {
        "argmax", "decode_attention", "paged_attention", "prefill_attention", "gemv", "store_kv", "fused_decode", "swiglu",
        "rms_norm", "gemm_invariant", "sample_rows", "decode_persistent"}
    assert GUARDED["paged_attention"] >= {"BLOCK_SIZE", "DECODE_THREADS", "BF16_PER_VECTOR"}


@pytest.mark.parametrize("file", [name for name, needs in GUARDED.items() if needs])
def test_kernel_refuses_to_compile_without_its_constants(ops, file):
    """Compiled without the -D options, each guarded file stops at its #error; with them (cuda_ops.kernel's
    options) it compiles, and with all but one of its constants it stops again, naming that one."""
    import cupy as cp

    from tinyvllm.model.backend.constants import nvrtc_defines
    source = (KERNELS_DIR / f"{file}.cu").read_text()
    base = ("-std=c++17", f"-I{KERNELS_DIR}")
    with pytest.raises(cp.cuda.compiler.CompileException, match="comes from Python"):
        cp.RawModule(code=source, options=base).compile()
    cp.RawModule(code=source, options=ops.NVRTC_OPTIONS).compile()
    for name in sorted(GUARDED[file]):
        defines = tuple(d for d in nvrtc_defines() if not d.startswith(f"-D{name}="))
        with pytest.raises(cp.cuda.compiler.CompileException, match=f"{name} comes from Python"):
            cp.RawModule(code=source, options=base + defines).compile()
