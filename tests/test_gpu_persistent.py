"""Chapter 8, last section, on the GPU: the persistent decode step (kernels/decode_persistent.cu) runs the fused
layer's instruction list in one launch and gives the fused layer's bits. Run with `make test-gpu`.

- greedy decode of random-weight Llamas (a tiny one with odd shapes, and Llama 3.2 1B's shapes with 2 layers) through
  CUDA graphs, the persistent step against the fused step, 1 to GEMV_MAX_ROWS rows: the logits of every step and the
  K/V pool bit for bit, the step buffers NaN-poisoned before every step; and against the unfused layer (different
  kernels, so within a tolerance, and the same greedy tokens);
- the engine's graphs time the persistent step beside the fused and the unfused one, and keep the fastest.
The twin (numpy_ops.decode_persistent) is tested against the fused layer on the CPU (tests/test_persistent.py).
"""
import numpy as np
import pytest

from tests.gpu_helpers import NAN_BF16, requires_gpu
from tests.numeric import rel_err

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.fixture(scope="module", params=["tiny", "llama-3.2-1b-2-layers"])
def model(request, tmp_path_factory):
    from tests.conftest import TINY_DIMS
    from tinyvllm.formats.checkpoints import synth_model
    from tinyvllm.model.model import Model
    dims = TINY_DIMS if request.param == "tiny" else dict(num_hidden_layers=2)
    path = synth_model("llama-3.2-1b", tmp_path_factory.mktemp("persistent") / "llama", seed=11, **dims)
    return Model(path, device="cuda", max_num_batched_tokens=256)


@pytest.fixture
def every_row_count_fused(monkeypatch):
    """The fused layer (and so the persistent step) for every row count its kernels take, not only the engine's."""
    from tinyvllm.model import decode
    from tinyvllm.model.backend import cuda_ops
    from tinyvllm.model.backend.constants import GEMV_MAX_ROWS
    monkeypatch.setattr(decode, "GEMV_DECODE_ROWS", GEMV_MAX_ROWS)
    monkeypatch.setattr(cuda_ops, "GEMV_DECODE_ROWS", GEMV_MAX_ROWS)


def poison(model) -> None:
    for buf in model.buffers.values():
        buf.fill(np.nan if buf.dtype == np.float32 else NAN_BF16)


def greedy(model, prompts: list[list[int]], steps: int, layer: str):
    """Prefill the prompts into a fresh pool, then `steps` greedy steps through the graphs of one layer:
    ([(tokens, logits)] per step, the pool)."""
    import cupy as cp

    from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
    from tinyvllm.model.cuda_graphs import GraphedDecode
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.prefill import prefill_batch
    n = len(prompts)
    blocks, pool = BlockManager(n * 8), PagedKVPool(model.cfg, model.ops, n * 8)
    first = prefill_batch(model, pool, [plan_prefill(blocks, s, p) for s, p in enumerate(prompts)])
    graphed = GraphedDecode(model, pool, max_num_seqs=8, layer=layer)
    tokens, history = cp.asnumpy(first.argmax(-1)).tolist(), []
    for _ in range(steps):
        poison(model)
        logits = cp.asnumpy(graphed(plan_decode(blocks, list(range(n)), tokens)))
        tokens = logits.argmax(-1).tolist()
        history.append((tokens, logits))
    return history, pool


def same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bits = np.uint32 if got.dtype == np.float32 else np.uint16
    differ = np.ascontiguousarray(got).view(bits) != np.ascontiguousarray(want).view(bits)
    assert not differ.any(), f"{what}: {int(differ.sum())} of {differ.size} differ, the first at {np.argwhere(differ)[0]}"


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_the_persistent_step_gives_the_fused_bits(model, n, every_row_count_fused):
    import cupy as cp
    seed = 70 + n
    rng = np.random.default_rng(seed)
    longest = min(60, model.max_num_batched_tokens // n)   # the n prompts are prefilled in one step
    prompts = [rng.integers(0, model.cfg.vocab_size, int(rng.integers(1, longest))).tolist() for _ in range(n)]
    persistent, persistent_pool = greedy(model, prompts, 24, "persistent")
    fused, fused_pool = greedy(model, prompts, 24, "fused")
    unfused, _ = greedy(model, prompts, 24, "unfused")
    for step, ((tokens, logits), (want_tokens, want), (plain_tokens, plain)) in enumerate(zip(persistent, fused,
                                                                                            unfused)):
        assert not np.isnan(logits).any(), f"step {step}: NaN logits (seed {seed})"
        same_bits(logits, want, f"step {step}: the persistent step's logits against the fused step's (seed {seed})")
        assert rel_err(logits, plain) < 1e-3 and tokens == plain_tokens, f"step {step}: against unfused (seed {seed})"
    same_bits(cp.asnumpy(persistent_pool.k), cp.asnumpy(fused_pool.k), f"the K pool (seed {seed})")
    same_bits(cp.asnumpy(persistent_pool.v), cp.asnumpy(fused_pool.v), f"the V pool (seed {seed})")


def test_the_engine_times_the_persistent_step_and_keeps_the_fastest(model):
    from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
    from tinyvllm.model.cuda_graphs import GraphedDecode
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.prefill import prefill_batch
    blocks, pool = BlockManager(8), PagedKVPool(model.cfg, model.ops, 8)
    prefill_batch(model, pool, [plan_prefill(blocks, 0, [1, 2, 3])])
    graphed = GraphedDecode(model, pool, max_num_seqs=4)
    graphed(plan_decode(blocks, [0], [4]))
    timings = graphed.timings[1]
    assert set(timings) == {"fused", "unfused", "persistent"} and all(t > 0 for t in timings.values()), timings
    assert graphed.chosen[1] == min(timings, key=timings.get)


def test_the_timeline_stamps_every_instruction_of_every_block_in_order(model):
    """bench/persistent_timeline.py reads these stamps: each block begins an instruction after it finished the one
    before (the barrier between), and finishes after it began."""
    import cupy as cp

    from bench.persistent_timeline import timeline
    names, nbytes, stamps, launch_ms = timeline(model, context=40, steps=2)
    assert names[0] == "embedding" and names[-1] == "rms_norm_gemv" and len(names) == len(nbytes) == stamps.shape[1]
    begin, finish = stamps[..., 0].astype(np.int64), stamps[..., 1].astype(np.int64)
    assert (begin > 0).all() and (finish >= begin).all(), "a block left an instruction unstamped"
    assert (begin[:, 1:] >= finish[:, :-1].max(axis=2, keepdims=True)).all(), "a block passed a barrier early"
    assert launch_ms > 0 and cp.cuda.runtime.deviceSynchronize() is None
