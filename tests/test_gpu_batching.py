"""Chapter 7 on the GPU: CUDA-graph decode replays equal eager decode steps, and the engine's batched
generation with graphs equals it without."""
import numpy as np
import pytest

from tests.gpu_helpers import requires_gpu
from tests.numeric import rel_err
from tests.test_gpu_decode import gpu_model  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.mark.parametrize("n", [1, 5, 16, 19])
def test_graph_replay_equals_eager_decode(gpu_model, n):  # noqa: F811
    import cupy as cp

    from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
    from tinyvllm.model.cuda_graphs import GraphedDecode
    from tinyvllm.model.decode import decode_batch
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.prefill import prefill_batch
    _, model = gpu_model
    rng = np.random.default_rng(n)
    prompts = [rng.integers(0, model.cfg.vocab_size, int(rng.integers(1, 50))).tolist() for _ in range(n)]
    eager_pool, graph_pool = (PagedKVPool(model.cfg, model.ops, num_blocks=n * 24) for _ in range(2))
    eager_blocks, graph_blocks = BlockManager(n * 24), BlockManager(n * 24)
    for pool, blocks in ((eager_pool, eager_blocks), (graph_pool, graph_blocks)):
        prefill_batch(model, pool, [plan_prefill(blocks, s, p) for s, p in enumerate(prompts)])
    graphed = GraphedDecode(model, graph_pool, max_num_seqs=32)
    for step in range(3):  # the first call captures, the next ones replay
        tokens = rng.integers(0, model.cfg.vocab_size, n).tolist()
        eager = cp.asnumpy(decode_batch(model, eager_pool, plan_decode(eager_blocks, list(range(n)), tokens)))
        replay = cp.asnumpy(graphed(plan_decode(graph_blocks, list(range(n)), tokens)))
        err = rel_err(replay, eager)
        assert err < 1e-3, f"n={n}, step {step}: {err:.2e}"
    assert graph_blocks.tables == eager_blocks.tables


def test_engine_with_graphs_equals_enforce_eager(gpu_model):  # noqa: F811
    from tinyvllm import LLM, SamplingParams
    path, _ = gpu_model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 3000, int(rng.integers(5, 200))).tolist() for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(1, 40, 24)]
    outs = {}
    for eager in (True, False):
        llm = LLM(str(path), device="cuda", num_blocks=400, max_num_seqs=16, enforce_eager=eager)
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.scheduler.block_manager.num_free == 400
    same = np.mean([a == b for a, b in zip(sum(outs[True], []), sum(outs[False], []))])
    assert [len(o) for o in outs[True]] == [p.max_tokens for p in params]
    assert same >= 0.98, f"only {same:.3f} of the tokens agree"
