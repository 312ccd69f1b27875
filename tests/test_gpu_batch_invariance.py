"""Chapter 7 on the GPU: the batch-invariant mode (LLM(batch_invariant=True)) — bit for bit, a sequence's
logits do not depend on what else is in its batch, where it sits there, or whether its prefix came from the
prefix cache.
- gemm_invariant: row i of x @ W^T has the same bits at T = 1, 3, 64, 255 in any order (NaN-poisoned
  outputs), and equals fp32 math within bf16 rounding; the default gemm does not keep its bits (the control:
  the comparison can fail);
- teacher-forced logits of 8 sequences through prefill_batch: alone, and in shuffled batches of 3, 64 and
  256 sequences: equal bits; a prompt whose first blocks are read from the pool (chunk attention) equals it
  prefilled whole;
- the engine: 32 prompts greedy alone and together, CUDA graphs on: the same tokens and the same
  logprobs, bit for bit; the prefix cache on and off: the same logprobs.
"""
import numpy as np
import pytest

from tests.gpu_helpers import bf16_pair, requires_gpu
from tests.numeric import rel_err
from tests.test_gpu_prefill import save_random_llama_with_tokenizer
from tinyvllm.formats.bf16 import bf16_bits_to_float32

pytestmark = [pytest.mark.gpu, requires_gpu]

DIMS = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_llama_with_tokenizer(tmp_path_factory.mktemp("invariant"), DIMS, seed=11)


def bits(a) -> np.ndarray:
    import cupy as cp
    a = cp.asnumpy(a)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


@pytest.mark.parametrize("f32", [False, True])
def test_gemm_invariant_rows_keep_their_bits_in_any_batch(f32):
    import cupy as cp

    from tinyvllm.model.backend import cuda_ops
    seed = 5 + f32
    rng = np.random.default_rng(seed)
    K, N = 2048, 1003   # N not a multiple of the 8 columns a block writes: the last block is partial
    x32, x = bf16_pair(rng, (256, K))
    w32, w = bf16_pair(rng, (N, K), scale=K ** -0.5)

    def run(gemm, rows: np.ndarray):   # the rows gathered into a fresh x; the output NaN until written
        out = cp.full((len(rows), N), np.nan, cp.float32) if f32 else cp.full((len(rows), N), 0x7FC0, cp.uint16)
        gemm(x[cp.asarray(rows)], w, out)
        return bits(out)

    everything = np.arange(256)
    full = run(cuda_ops.gemm_invariant, everything)
    got = full.view(np.float32) if f32 else bf16_bits_to_float32(full)
    assert rel_err(got, x32 @ w32.T) < (1e-5 if f32 else 1e-2), f"seed {seed}"
    for T in (1, 3, 64, 255):
        rows = rng.choice(256, T, replace=False)
        assert np.array_equal(run(cuda_ops.gemm_invariant, rows), full[rows]), f"T={T}, seed {seed}"
    if f32:   # the control: cuBLAS at T = 256 against the gemv kernel at T = 1 (the default mode's dispatch)
        default_full = run(cuda_ops.gemm, everything)
        alone = np.concatenate([run(cuda_ops.gemm, np.array([i])) for i in range(8)])
        assert not np.array_equal(alone, default_full[:8]), "the default gemm kept its bits: the control failed"


def teacher_forced(model, prompts: list[list[int]]) -> list[np.ndarray]:
    """Every position's logits of each prompt, all prefilled in ONE pass (fresh pool)."""
    import cupy as cp

    from tinyvllm.engine.block_manager import BlockManager, plan_prefill
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.prefill import prefill_batch
    blocks = sum(-(-len(p) // 16) for p in prompts)
    pool, manager = PagedKVPool(model.cfg, model.ops, num_blocks=blocks), BlockManager(blocks)
    logits = cp.asnumpy(prefill_batch(model, pool, [plan_prefill(manager, s, p) for s, p in enumerate(prompts)],
                                      all_logits=True))
    ends = np.cumsum([len(p) for p in prompts])
    return [logits[end - len(p):end] for p, end in zip(prompts, ends)]


def test_teacher_forced_logits_do_not_depend_on_the_batch(model_dir):
    from tinyvllm.model.model import Model
    seed = 21
    rng = np.random.default_rng(seed)
    model = Model(model_dir, device="cuda", max_num_batched_tokens=8192, batch_invariant=True)
    prompts = [rng.integers(0, DIMS["vocab_size"], int(rng.integers(2, 40))).tolist() for _ in range(256)]
    alone = [teacher_forced(model, [p])[0] for p in prompts[:8]]
    for size in (3, 64, 256):
        batch = [*range(min(8, size)), *rng.choice(np.arange(8, 256), size - min(8, size), replace=False)]
        order = rng.permutation(size)            # shuffled: the targets anywhere in the batch
        got = teacher_forced(model, [prompts[batch[i]] for i in order])
        for position, i in enumerate(order):
            if batch[i] < 8:
                assert np.array_equal(got[position].view(np.uint32), alone[batch[i]].view(np.uint32)), \
                    f"prompt {batch[i]} at row {position} of a batch of {size}, seed {seed}"


def test_a_prefix_read_from_the_pool_gives_the_same_logits(model_dir):
    import cupy as cp

    from tinyvllm.engine.block_manager import BlockManager, plan_prefill
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.model import Model
    from tinyvllm.model.prefill import prefill_batch
    seed = 22
    rng = np.random.default_rng(seed)
    model = Model(model_dir, device="cuda", max_num_batched_tokens=8192, batch_invariant=True)
    prompt = rng.integers(0, DIMS["vocab_size"], 150).tolist()
    whole = teacher_forced(model, [prompt])[0]
    for cached in (16, 64, 144):   # whole blocks in the pool first, the rest as a chunk reading them
        pool, manager = PagedKVPool(model.cfg, model.ops, num_blocks=10), BlockManager(10)
        prefill_batch(model, pool, [plan_prefill(manager, 0, prompt, 0, cached)])
        rest = cp.asnumpy(prefill_batch(model, pool, [plan_prefill(manager, 0, prompt, cached)], all_logits=True))
        assert np.array_equal(rest.view(np.uint32), whole[cached:].view(np.uint32)), f"cached {cached}, seed {seed}"


def greedy(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], [[sorted(d.items()) for d in o.outputs[0].logprobs] for o in outs]


def test_greedy_alone_and_together_are_the_same_bits(model_dir):
    from tinyvllm import LLM, SamplingParams
    seed = 23
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, DIMS["vocab_size"], int(rng.integers(5, 300))).tolist() for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    llm = LLM(str(model_dir), device="cuda", num_blocks=1200, max_num_seqs=32, batch_invariant=True,
              enable_prefix_caching=False)
    alone = [greedy(llm, [p], params) for p in prompts]
    tokens, logprobs = greedy(llm, prompts, params)
    other_tokens = [i for i, (t, _) in enumerate(alone) if t[0] != tokens[i]]
    other_logprobs = [i for i, (_, lp) in enumerate(alone) if lp[0] != logprobs[i]]
    assert not other_tokens and not other_logprobs, \
        f"alone vs together: tokens differ for prompts {other_tokens}, logprobs for {other_logprobs}; seed {seed}"
    cached = LLM(str(model_dir), device="cuda", num_blocks=1200, max_num_seqs=32, batch_invariant=True,
                 enable_prefix_caching=True)
    greedy(cached, prompts[:8], params)                     # their full blocks are now in the prefix cache
    assert greedy(cached, prompts, params) == (tokens, logprobs), f"prefix cache hits changed bits, seed {seed}"
