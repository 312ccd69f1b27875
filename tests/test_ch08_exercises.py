"""Chapter 8 graders: a decode step's bytes and floor (Exercises 8.1, 8.2), the fused kernels' thread blocks in
NumPy (8.3, 8.4), on the CPU; the residual-add epilogue in CUDA C (8.5), on a GPU.

step_bytes is checked against a count made from the checkpoint's own tensor shapes (expected_tensor_shapes:
every HF tensor, K and V rows per layer), and against the bytes bench/decode.py recorded on an H200; floor_ms
against that run's floor. The thread blocks run in a random order into outputs full of NaN, each checked
right after its call for writing its own columns and nothing else, and the whole grid against RMSNorm and
the projection computed in float64. Then both run inside a whole decode step (fusion.decode_fused) on a tiny
random model, whose logits and greedy tokens must be the engine's decode_batch's. The kernel of 8.5 is
compiled with cupy.RawModule and compared with its NumPy twin; without a GPU its graders are skipped.

The last tests (not graders) check that the chapter's generated tables are the ones in its README.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from chapters.ch08_fusion import fusion, plots
from chapters.grading import exercises
from tests.numeric import F32, randn, rel_err, same
from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
from tinyvllm.formats.checkpoints import PRESETS
from tinyvllm.formats.config import expected_tensor_shapes
from tinyvllm.model.backend import cuda_available
from tinyvllm.model.decode import decode_batch
from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill_batch

ROOT = Path(__file__).resolve().parent.parent
H200_RUN = json.loads((ROOT / "bench" / "results" / plots.BEFORE_FILE).read_text())
MODELS = ["llama-3.2-1b", "llama-3.1-8b", "smollm2-135m"]   # tied, untied, tied


# ---------- Exercise 8.1: step_bytes ----------

def bytes_from_tensor_shapes(cfg, batch: int, context_len: int) -> int:
    """Every tensor of the checkpoint once (bf16), but not the embedding when a separate lm_head is the one
    read; plus each sequence's K and V: the k_proj and v_proj output rows of every layer, per token."""
    shapes = expected_tensor_shapes(cfg)
    weights = sum(int(np.prod(s)) for name, s in shapes.items()
                  if cfg.tie_word_embeddings or name != "model.embed_tokens.weight")
    kv_per_token = sum(shapes[f"model.layers.{i}.self_attn.{p}_proj.weight"][0]
                       for i in range(cfg.num_hidden_layers) for p in "kv")
    return 2 * (weights + batch * context_len * kv_per_token)


@pytest.mark.ch8
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("batch, context_len", [(1, 0), (1, 512), (8, 1), (64, 4096)])
def test_step_bytes_counts_the_weights_once_and_every_sequences_kv(impl, model, batch, context_len):
    cfg = PRESETS[model]
    got = impl("step_bytes")(cfg, batch, context_len)
    assert isinstance(got, (int, np.integer)), f"return an int (a count of bytes), got {type(got).__name__}"
    same(int(got), bytes_from_tensor_shapes(cfg, batch, context_len),
         f"step_bytes({model}, batch={batch}, context_len={context_len})")


@pytest.mark.ch8
def test_step_bytes_of_llama_1b_is_what_the_h200_run_read(impl):
    """bench/decode.py counted the bytes of the same step from the engine's weight blob."""
    same(int(impl("step_bytes")(PRESETS["llama-3.2-1b"], 1, H200_RUN["context"])), H200_RUN["bytes_per_step"],
         f"Llama 3.2 1B, batch 1, context {H200_RUN['context']}: bytes_per_step in bench/results/{plots.BEFORE_FILE}")


@pytest.mark.ch8
def test_step_bytes_shares_the_weights_across_the_batch(impl):
    """Hand-derived: one more sequence adds its K/V only; one more token of context adds one token's K/V."""
    cfg, step_bytes = PRESETS["llama-3.2-1b"], impl("step_bytes")
    kv_token = 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim   # 32 KiB
    same(int(step_bytes(cfg, 2, 100) - step_bytes(cfg, 1, 100)), 100 * kv_token,
         "a second sequence of 100 tokens adds 100 tokens of K/V, and no weights")
    same(int(step_bytes(cfg, 3, 101) - step_bytes(cfg, 3, 100)), 3 * kv_token,
         "one more token of context in each of 3 sequences adds 3 tokens of K/V")


# ---------- Exercise 8.2: floor_ms ----------

@pytest.mark.ch8
def test_floor_ms_of_the_h200_run(impl):
    expected = H200_RUN["floor_ms"]
    got = impl("floor_ms")(H200_RUN["bytes_per_step"], H200_RUN["copy_bandwidth_gb_s"])
    assert abs(got - expected) < 1e-9, (
        f"{H200_RUN['bytes_per_step']:,} bytes at {H200_RUN['copy_bandwidth_gb_s']} GB/s: expected {expected!r} ms, "
        f"got {got!r} ({type(got).__name__}), off by {abs(got - expected):.3g} ms (tolerance 1e-9 ms)")


@pytest.mark.ch8
@pytest.mark.parametrize("nbytes, gbps, ms", [(10**9, 1000.0, 1.0), (4_800_000_000, 4800.0, 1.0),
                                               (538_000_000, 25.5, 21.098039215686274), (0, 4000.0, 0.0)])
def test_floor_ms_hand_derived(impl, nbytes, gbps, ms):
    got, tolerance = impl("floor_ms")(nbytes, gbps), 1e-9 * max(ms, 1)
    assert abs(got - ms) < tolerance, (
        f"{nbytes:,} bytes at {gbps} GB/s (10^9 bytes/s): expected {ms!r} ms, got {got!r} ({type(got).__name__}), "
        f"off by {abs(got - ms):.3g} ms (tolerance {tolerance:.3g} ms)")


# ---------- Exercises 8.3 and 8.4: one thread block at a time ----------

def rms_norm64(residual, norm_weight, eps):
    x = residual.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * norm_weight.astype(np.float64)


def silu64(g):
    with np.errstate(over="ignore"):
        return g / (1 + np.exp(-g))


def run_blocks(f, inputs: tuple, out_cols: int, T: int, eps: float, cols_per_block: int, rng) -> np.ndarray:
    """Call f(*inputs, out, eps, block, cols_per_block) for every block in a random order, into an out of
    T rows (a view of T + 1 NaN rows: the spare one must stay NaN), checking after each call that the block
    wrote its own columns and nothing else. Returns the T rows."""
    buffer = np.full((T + 1, out_cols), np.nan, F32)
    out = buffer[:T]
    written = np.zeros(out_cols, bool)
    for block in rng.permutation(fusion.num_blocks(out_cols, cols_per_block)):
        first, last = block * cols_per_block, min((block + 1) * cols_per_block, out_cols) - 1
        assert f(*inputs, out, eps, int(block), cols_per_block) is None, \
            "write into the output in place and return nothing (the next kernel reads that buffer)"
        written[first:last + 1] = True
        mine = out[:, first:last + 1]
        assert np.isfinite(mine).all(), (f"block {block} (columns {first}..{last} of {out_cols}) left NaN or inf "
                                         "in its own columns")
        stray = np.flatnonzero(~written & ~np.isnan(out).all(axis=0))
        assert not stray.size, (f"block {block} (columns {first}..{last}) wrote column {stray[0]}, which belongs "
                                f"to block {stray[0] // cols_per_block}: a block computes only its own columns")
    assert np.isnan(buffer[T]).all(), f"out has {T} rows: something was written into the row after them"
    return out


SHAPES = {  # T rows, hidden, output columns, columns per block
    "one block": (1, 64, 8, 8),
    "last block short": (3, 576, 100, 8),
    "block wider than the output": (8, 64, 13, 32),
    "a column per block": (2, 128, 50, 1),
    "eight rows": (8, 96, 77, 16),
    "hidden not a multiple of 4": (3, 67, 20, 8),
}


@pytest.mark.ch8
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("eps", [1e-5, 1.0])
def test_rms_norm_gemv_block_grid_equals_rms_norm_then_gemv(impl, shape, eps, rng):
    T, h, N, cols = SHAPES[shape]
    residual = randn(rng, T, h) * np.logspace(-1, 1.5, T, dtype=F32)[:, None]   # rows of very different sizes
    norm_weight, w = randn(rng, h), randn(rng, N, h, scale=0.1)
    kept = residual.copy(), norm_weight.copy(), w.copy()
    out = run_blocks(impl("rms_norm_gemv_block"), (residual, norm_weight, w), N, T, eps, cols, rng)
    for name, now, before in zip(("residual", "norm_weight", "w"), (residual, norm_weight, w), kept):
        assert np.array_equal(now, before), f"{name} was changed: a block only reads its inputs"
    err = rel_err(out, rms_norm64(residual, norm_weight, eps) @ w.T.astype(np.float64))
    assert err < 1e-5, (f"{shape}, eps {eps}: relative error {err:.2e} vs RMSNorm then the product in float64 "
                        "(tolerance 1e-05)")


@pytest.mark.ch8
def test_rms_norm_gemv_block_of_constant_rows_hand_derived(impl, rng):
    """A row of equal values a: its root mean square is |a|, so normed = a / sqrt(a^2 + eps) * norm_weight, and
    a zero row gives zeros (eps keeps the division finite)."""
    h, N, eps = 64, 24, 1e-5
    residual = np.stack([np.full(h, 3.0, F32), np.full(h, -0.5, F32), np.zeros(h, F32)])
    norm_weight, w = randn(rng, h), randn(rng, N, h)
    out = run_blocks(impl("rms_norm_gemv_block"), (residual, norm_weight, w), N, 3, eps, 8, rng)
    direction = w.astype(np.float64) @ norm_weight
    for row, a in enumerate((3.0, -0.5, 0.0)):
        expected = a / np.sqrt(a * a + eps) * direction
        err = np.abs(out[row] - expected).max() / np.abs(direction).max()
        assert err < 1e-6, f"row {row}, every value {a}: expected {a}/sqrt({a}^2 + eps) * (w @ norm_weight), " \
                           f"off by {err:.1e}"


@pytest.mark.ch8
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_gemv_swiglu_block_grid_equals_norm_gate_up_then_swiglu(impl, shape, rng):
    T, h, inter, cols = SHAPES[shape]
    residual = randn(rng, T, h, scale=4.0)
    norm_weight, w_gate_up = randn(rng, h), randn(rng, 2 * inter, h, scale=0.3)
    kept = residual.copy(), w_gate_up.copy()
    act = run_blocks(impl("rms_norm_gemv_swiglu_block"), (residual, norm_weight, w_gate_up), inter, T, 1e-5, cols,
                     rng)
    assert np.array_equal(residual, kept[0]) and np.array_equal(w_gate_up, kept[1]), \
        "residual or w_gate_up was changed: a block only reads its inputs"
    gate_up = rms_norm64(residual, norm_weight, 1e-5) @ w_gate_up.T.astype(np.float64)
    expected = silu64(gate_up[:, :inter]) * gate_up[:, inter:]
    err = rel_err(act, expected)
    assert err < 1e-5, (f"{shape}: relative error {err:.2e} vs silu(gate) * up in float64 (tolerance 1e-05); "
                        f"act column j pairs gate row j with up row inter + j = {inter} + j of w_gate_up")


@pytest.mark.ch8
def test_rms_norm_gemv_swiglu_block_at_extreme_gates_hand_derived(impl, rng):
    """A residual row sqrt(h) e_0 with unit norm weights and eps 0 normalizes to itself, so gate_j is what
    w_gate_up[j, 0] * sqrt(h) says: silu(-200) is -0 (not NaN), silu(0) is 0, silu(90) is 90. up_j = 1."""
    h, gates = 16, np.array([-200, -90, -20, -1, 0, 1, 20, 90], F32)
    inter = len(gates)
    residual = np.zeros((1, h), F32)
    residual[0, 0] = np.sqrt(h)
    w_gate_up = np.zeros((2 * inter, h), F32)
    w_gate_up[:inter, 0], w_gate_up[inter:, 0] = gates / np.sqrt(h), 1 / np.sqrt(h)
    act = run_blocks(impl("rms_norm_gemv_swiglu_block"), (residual, np.ones(h, F32), w_gate_up), inter, 1, 0.0, 3,
                     rng)
    expected = silu64(gates.astype(np.float64))
    bad = np.flatnonzero(~np.isclose(act[0], expected, rtol=1e-5, atol=1e-6))
    assert not bad.size, (f"gate {gates[bad[0]]:g}: expected silu = {expected[bad[0]]:.6g}, got {act[0, bad[0]]:.6g} "
                          f"(all gates {gates.tolist()})")


# ---------- 8.3 and 8.4 together: a fused decode step in the engine ----------

@pytest.mark.ch8
def test_fused_decode_step_on_your_blocks_matches_the_engine(impl, monkeypatch, tiny_model_dir, rng):
    """A tiny random model: a prefill, then 4 decode steps by decode_batch and by the fused layer
    (fusion.decode_fused, running your thread blocks), from the same plans: same logits, same greedy tokens."""
    monkeypatch.setattr(fusion, "rms_norm_gemv_block", impl("rms_norm_gemv_block"))
    monkeypatch.setattr(fusion, "rms_norm_gemv_swiglu_block", impl("rms_norm_gemv_swiglu_block"))
    model = Model(tiny_model_dir, "cpu", max_num_batched_tokens=64)
    blocks = BlockManager(8)
    pool, fused_pool = PagedKVPool(model.cfg, model.ops, 8), PagedKVPool(model.cfg, model.ops, 8)
    prompt = rng.integers(0, model.cfg.vocab_size, int(rng.integers(5, 40))).tolist()
    plans = [plan_prefill(blocks, 0, prompt)]
    token = int(prefill_batch(model, pool, plans)[0].argmax())
    prefill_batch(model, fused_pool, plans)
    for step in range(4):
        plan = plan_decode(blocks, [0], [token])
        expected = decode_batch(model, pool, plan).copy()
        got = fusion.decode_fused(model, fused_pool, plan, cols_per_block=int(rng.choice([1, 8, 24])))
        err = rel_err(got, expected)
        assert err < 1e-5, f"decode step {step}: logits differ from decode_batch's by {err:.2e} (tolerance 1e-05)"
        token = int(expected[0].argmax())
        same(int(got[0].argmax()), token, f"decode step {step}: the greedy token")


# ---------- Exercise 8.5 (GPU): the gemv_add kernel in CUDA C vs its NumPy twin ----------

requires_gpu = pytest.mark.skipif(not cuda_available(), reason="Exercise 8.5 is graded on a GPU "
                                  "(needs CuPy and an NVIDIA GPU: pip install -e '.[gpu]')")
MARKER = np.float32(12345.0)   # fills the memory after the last row: a write past it shows


@pytest.fixture
def kernel_source(request):
    """kernel_source(name) -> the CUDA C under test: the chapter's .cu file, or the student's string."""
    def get(name: str) -> str:
        if request.config.getoption("--impl") == "student":
            return getattr(exercises(8), name)
        return (ROOT / exercises(8).GPU_EXERCISES[name]).read_text()
    return get


def compile_gemv_add(source: str, rows: int):
    """The gemv_add<rows> instance of the source, compiled as cuda_ops.kernel compiles the engine's."""
    import cupy as cp

    from tinyvllm.model.backend.cuda_ops import NVRTC_OPTIONS  # the engine's include path and -D constants
    name = f"gemv_add<{rows}>"
    return cp.RawModule(code=source, options=NVRTC_OPTIONS, name_expressions=[name]).get_function(name)


@pytest.mark.ch8
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("K, N", [(64, 8), (576, 13), (2048, 2048), (8192, 300)])
def test_gemv_add_kernel_source_matches_the_numpy_twin(kernel_source, rows, K, N, rng):
    import cupy as cp

    from tests.gpu_helpers import bf16_pair
    from tinyvllm.model.backend.constants import GEMV_COLUMNS_PER_BLOCK, GEMV_THREADS
    kernel = compile_gemv_add(kernel_source("GEMV_ADD_KERNEL_SOURCE"), rows)
    x32, x = bf16_pair(rng, (rows, K))
    w32, w = bf16_pair(rng, (N, K), scale=0.05)
    before = randn(rng, rows, N, scale=3.0)
    memory = cp.full(rows * N + 64, MARKER, cp.float32)   # residual (rows, N), then 64 floats that must survive
    memory[:rows * N] = cp.asarray(before.ravel())
    kernel((fusion.num_blocks(N, GEMV_COLUMNS_PER_BLOCK),), (GEMV_THREADS,), (x, w, memory, np.int32(K), np.int32(N)))
    got = cp.asnumpy(memory)
    assert (got[rows * N:] == MARKER).all(), "the kernel wrote past the last row of the residual"
    expected = before.copy()
    fusion.gemv_add(x32, w32, expected)
    added, should_add = got[:rows * N].reshape(rows, N) - before, expected - before
    # a sum rounded to bf16 before the add (as the engine's gemv_add rounds it) is off by up to 2^-9 of itself
    off = np.abs(added - should_add) > 2.0 ** -8 * np.abs(should_add) + 1e-4 * np.abs(should_add).max()
    if off.any():
        b, j = (int(i) for i in np.argwhere(off)[0])
        raise AssertionError(f"{int(off.sum())} of {off.size} residual values wrong, the first at row {b}, column "
                             f"{j}: it should have grown by {should_add[b, j]:.5g}, it grew by {added[b, j]:.5g}")
    err = rel_err(added, should_add)
    assert err < 5e-3, f"what was added to the residual: relative error {err:.2e} vs x @ w.T (tolerance 5e-03)"


# ---------- not graders: the chapter's README shows what its generators produce ----------

def test_readme_tables_are_the_generated_ones():
    text = (ROOT / "chapters" / "ch08_fusion" / "README.md").read_text()
    for name in ("per_op_markdown", "layer_table_markdown"):
        assert getattr(plots, name)() in text, \
            f"chapters/ch08_fusion/README.md's table differs from plots.{name}(): paste it again"


def test_readme_measured_section_is_generated_from_the_newest_fused_result():
    text = (ROOT / "chapters" / "ch08_fusion" / "README.md").read_text()
    assert plots.measured_section(text) == plots.measured_after_fusion_markdown(), \
        "the README's 'Measured after fusion' section is stale: run `python -m chapters.ch08_fusion.plots`"


def test_measured_section_says_pending_without_a_fused_result_and_shows_one(tmp_path):
    (tmp_path / "decode-20261130-004843.json").write_text(json.dumps(H200_RUN))
    assert plots.measured_after_fusion_markdown(tmp_path) == plots.PENDING
    fused = dict(H200_RUN, fused={"ms_per_token": 1.234, "kernel_ms": 0.987,
                                  "kernel_ms_by_op": {"rms_norm_gemv": 0.2, "gemv_add": 0.3}})
    (tmp_path / "decode-20991231-000000.json").write_text(json.dumps(fused))
    table = plots.measured_after_fusion_markdown(tmp_path)
    assert "decode-20991231-000000.json" in table and "1.234" in table and "0.987" in table and "gemv_add" in table
    other_gpu = dict(fused, machine={**H200_RUN["machine"], "gpu": "NVIDIA H100 80GB HBM3"})
    (tmp_path / "decode-20991231-120000.json").write_text(json.dumps(other_gpu))   # newer, but another floor
    assert plots.newest_fused_result(tmp_path)[0] == "decode-20991231-000000.json"
