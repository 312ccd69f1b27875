"""Chapter 6 on the GPU: the paged attention kernel against its NumPy twin on fragmented pools, the paged
decode step against the contiguous one, and pool sizing from free device memory."""
import numpy as np
import pytest

from tests.gpu_helpers import bf16_pair, from_bf16, nan_bf16, requires_gpu
from tests.numeric import rel_err
from tests.test_gpu_decode import gpu_model, to_gpu_bf16  # noqa: F401  (gpu_model is a fixture)
from tests.test_paged import LENGTHS, fragmented_pool
from tinyvllm.model.backend import numpy_ops as twin

pytestmark = [pytest.mark.gpu, requires_gpu]


# None: the engine's choice; 16 leaves short rows' splits empty; split_tokens: the batch-invariant mode's parts of
# a size set by each row's length (4097 keys in 16 parts of 320, or in 4 parts of 1,040 at 16 per step)
@pytest.mark.parametrize("splits, split_tokens", [(None, 0), (1, 0), (2, 0), (16, 0), (16, 64), (4, 16)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (9, 3, 64), (8, 1, 128), (16, 8, 32)])
def test_paged_attention_kernel_matches_twin(heads, kv_heads, head_dim, splits, split_tokens, rng):
    import cupy as cp

    from tinyvllm.model.backend import cuda_ops
    k32, v32, tables, seqs = fragmented_pool(rng, LENGTHS, kv_heads, head_dim)  # NaN in every unused slot
    (k_gpu, k32), (v_gpu, v32) = to_gpu_bf16(k32), to_gpu_bf16(v32)
    n, q_cols = len(seqs), heads * head_dim
    qkv32, qkv = bf16_pair(rng, (n, q_cols + 2 * kv_heads * head_dim), scale=2.0)
    lengths = np.array(LENGTHS, np.int32)
    out = nan_bf16((n + 1, q_cols))
    cuda_ops.paged_attention(qkv, k_gpu, v_gpu, cp.asarray(tables), cp.asarray(lengths), out[:n], heads, splits,
                             split_tokens)
    expected = np.empty((n, q_cols), np.float32)
    twin.paged_attention(qkv32, k32, v32, tables, lengths, expected, heads)
    got = from_bf16(out)
    assert np.isnan(got[n]).all(), "wrote past the last row"
    for b in range(n):
        assert not np.isnan(got[b]).any(), f"row {b} ({lengths[b]} keys): NaN (read a slot it does not own?)"
        assert rel_err(got[b], expected[b]) < 1e-2, f"row {b} ({lengths[b]} keys)"


def test_paged_decode_step_equals_contiguous_decode_step(gpu_model):  # noqa: F811
    import cupy as cp

    from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
    from tinyvllm.model.decode import decode_batch, decode_step
    from tinyvllm.model.kv_pool import ContiguousKVCache, PagedKVPool
    from tinyvllm.model.prefill import prefill, prefill_batch
    _, model = gpu_model
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (1, 16, 17, 255, 700)]
    nxt = rng.integers(0, model.cfg.vocab_size, 5).tolist()
    paged, blocks = PagedKVPool(model.cfg, model.ops, num_blocks=120), BlockManager(120)
    blocks.allocate(99, 100)                      # fragment the pool first
    prefill_batch(model, paged, [plan_prefill(blocks, 0, prompts[0])])
    blocks.free(99)
    contiguous = ContiguousKVCache(model.cfg, model.ops, num_seqs=5, max_len=702)
    for s, p in enumerate(prompts):
        if s:
            prefill_batch(model, paged, [plan_prefill(blocks, s, p)])
        prefill(model, p, cache=contiguous, seq=s)
    for step in range(2):
        a = cp.asnumpy(decode_batch(model, paged, plan_decode(blocks, list(range(5)), nxt)))
        b = cp.asnumpy(decode_step(model, nxt, contiguous, list(range(5))))
        assert rel_err(a, b) < 1e-3, f"step {step}"  # same kernels and inputs: only the slot lookup differs


def test_pool_is_sized_from_free_device_memory(gpu_model):  # noqa: F811
    import cupy as cp

    from tinyvllm.model.kv_pool import bytes_per_block, pool_blocks
    _, model = gpu_model
    free, total = cp.cuda.runtime.memGetInfo()
    per_block = bytes_per_block(model.cfg, 2)
    blocks = pool_blocks(model.cfg, model.ops, gpu_memory_utilization=0.05)
    pool = cp.get_default_memory_pool()
    budget = 0.05 * total - (total - free - (pool.total_bytes() - pool.used_bytes()))
    assert blocks == int(budget // per_block) and blocks > 0
