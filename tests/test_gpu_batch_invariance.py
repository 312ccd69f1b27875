"""Chapter 7 on the GPU: the batch-invariant mode (LLM(batch_invariant=True)) — bit for bit, a sequence's
logits do not depend on what else is in its batch, where it sits there, or whether its prefix came from the
prefix cache.
- gemm_invariant (tensor cores): row i of x @ W^T has the same bits at T = 1 to 1,100 in any order, on each side
  of every tile switch (NaN-poisoned outputs), and equals fp32 math within bf16 rounding; every block tile gives the
  same bits; the default gemm does not keep its bits (the control: the comparison can fail);
- paged attention split by each row's length: a row alone and among 64 shuffled rows, the same bits; the default
  split (by batch size) does differ;
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
from tinyvllm.formats.bf16 import bf16_bits_to_float32, float32_to_bf16_bits

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


@pytest.mark.parametrize("f32, K", [(False, 2048), (True, 2048), (False, 576)])
def test_gemm_invariant_rows_keep_their_bits_in_any_batch(f32, K):
    """K = 576 (SmolLM2): 18 chunks of 32, which no stage of 64 or 128 columns divides: the last stage is partial."""
    import cupy as cp

    from tinyvllm.model.backend import cuda_ops
    seed = 5 + f32 + K
    rng = np.random.default_rng(seed)
    rows, N = 1100, 1003   # N no multiple of a tile's columns, rows more than one 128-row tile: partial tiles
    x32, x = bf16_pair(rng, (rows, K))
    w32, w = bf16_pair(rng, (N, K), scale=K ** -0.5)

    def run(gemm, picked: np.ndarray):   # the rows gathered into a fresh x; the output NaN until written
        out = cp.full((len(picked), N), np.nan, cp.float32) if f32 else cp.full((len(picked), N), 0x7FC0, cp.uint16)
        gemm(x[cp.asarray(picked)], w, out)
        return bits(out)

    everything = np.arange(rows)
    full = run(cuda_ops.gemm_invariant, everything)
    got = full.view(np.float32) if f32 else bf16_bits_to_float32(full)
    assert rel_err(got, x32 @ w32.T) < (1e-5 if f32 else 1e-2), f"seed {seed}"
    for T in (1, 3, 32, 33, 255, 256, 257, 1000):   # each side of every tile switch, shuffled rows
        picked = rng.choice(rows, T, replace=False)
        assert np.array_equal(run(cuda_ops.gemm_invariant, picked), full[picked]), f"T={T}, seed {seed}"
    if f32:   # the control: cuBLAS at T = 1100 against the gemv kernel at T = 1 (the default mode's dispatch)
        default_full = run(cuda_ops.gemm, everything)
        alone = np.concatenate([run(cuda_ops.gemm, np.array([i])) for i in range(8)])
        assert not np.array_equal(alone, default_full[:8]), "the default gemm kept its bits: the control failed"


# tiles the engine does not use among them: any tile must give the same bits, by construction (gemm_invariant.cu)
OTHER_TILES = [(1, 2, 1, 1, 128, 6), (1, 4, 2, 1, 64, 4), (2, 4, 4, 2, 64, 3), (4, 2, 2, 4, 32, 4)]


def test_every_block_tile_gives_the_same_bits():
    import cupy as cp

    from tinyvllm.model.backend import cuda_ops
    from tinyvllm.model.backend.constants import INVARIANT_GEMM_TILES, GemmTile
    seed = 9
    rng = np.random.default_rng(seed)
    T, K, N = 300, 1056, 517
    _, x = bf16_pair(rng, (T, K))
    _, w = bf16_pair(rng, (N, K), scale=K ** -0.5)
    results = {}
    for tile in [t for _, t in INVARIANT_GEMM_TILES] + [GemmTile(*t) for t in OTHER_TILES]:
        out = cp.full((T, N), np.nan, cp.float32)
        cuda_ops.gemm_invariant_tiled(x, w, out, tile)
        results[tile] = bits(out)
    first = next(iter(results.values()))
    assert not np.isnan(first.view(np.float32)).any(), f"an element left unwritten, seed {seed}"
    differ = [tile for tile, got in results.items() if not np.array_equal(got, first)]
    assert not differ, f"tiles {differ} give other bits than {next(iter(results))}, seed {seed}"


def test_paged_attention_rows_keep_their_bits_in_any_batch():
    """The invariant mode's split (parts sized by the row's own length) against the default's (a split count from
    the batch size): a row alone and among 64 shuffled rows. The default must differ for the test to mean anything."""
    import cupy as cp

    from tests.test_paged import fragmented_pool
    from tinyvllm.model.backend import cuda_ops
    from tinyvllm.model.backend.constants import INVARIANT_SPLIT_TOKENS, MAX_SPLITS
    seed = 31
    rng = np.random.default_rng(seed)
    heads, kv_heads, d = 32, 8, 64
    lengths = rng.integers(1, 3000, 64).astype(np.int32)
    k32, v32, tables, _ = fragmented_pool(rng, lengths.tolist(), kv_heads, d)
    k = cp.asarray(float32_to_bf16_bits(np.nan_to_num(k32)))
    v = cp.asarray(float32_to_bf16_bits(np.nan_to_num(v32)))
    _, qkv = bf16_pair(rng, (64, (heads + 2 * kv_heads) * d), scale=2.0)

    def attend(rows: np.ndarray, **split) -> np.ndarray:
        out = cp.full((len(rows), heads * d), 0x7FC0, cp.uint16)
        cuda_ops.paged_attention(qkv[cp.asarray(rows)], k, v, cp.asarray(tables[rows]), cp.asarray(lengths[rows]),
                                 out, heads, **split)
        return cp.asnumpy(out)

    invariant, default = dict(splits=MAX_SPLITS, split_tokens=INVARIANT_SPLIT_TOKENS), dict(splits=None)
    order = rng.permutation(64)
    together = {mode: dict(zip(order, attend(order, **split))) for mode, split in
                (("invariant", invariant), ("default", default))}
    longest = np.argsort(lengths)[-8:]
    alone_invariant = [attend(np.array([r]), **invariant)[0] for r in longest]
    assert all(np.array_equal(a, together["invariant"][r]) for a, r in zip(alone_invariant, longest)), f"seed {seed}"
    alone_default = [attend(np.array([r]), **default)[0] for r in longest]
    assert not all(np.array_equal(a, together["default"][r]) for a, r in zip(alone_default, longest)), \
        f"the default split kept every row's bits: the control failed, seed {seed}"


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


@pytest.mark.parametrize("invariant", [True, False])
def test_teacher_forced_logits_do_not_depend_on_the_batch(model_dir, invariant):
    """invariant=False is the control: in the default mode some prompt's logits do change with the batch."""
    from tinyvllm.model.model import Model
    seed = 21
    rng = np.random.default_rng(seed)
    model = Model(model_dir, device="cuda", max_num_batched_tokens=8192, batch_invariant=invariant)
    prompts = [rng.integers(0, DIMS["vocab_size"], int(rng.integers(2, 40))).tolist() for _ in range(256)]
    alone = [teacher_forced(model, [p])[0] for p in prompts[:8]]
    differ = []
    for size in (3, 64, 256):
        batch = [*range(min(8, size)), *rng.choice(np.arange(8, 256), size - min(8, size), replace=False)]
        order = rng.permutation(size)            # shuffled: the targets anywhere in the batch
        got = teacher_forced(model, [prompts[batch[i]] for i in order])
        differ += [(batch[i], position, size) for position, i in enumerate(order) if batch[i] < 8
                   and not np.array_equal(got[position].view(np.uint32), alone[batch[i]].view(np.uint32))]
    if invariant:
        assert not differ, f"(prompt, row, batch size) with other logits than alone: {differ}, seed {seed}"
    else:
        assert differ, f"the default mode kept every prompt's bits: the control failed, seed {seed}"


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


def generated(llm, prompts, params):   # the tokens and logprobs each prompt gets
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
    alone = [generated(llm, [p], params) for p in prompts]
    tokens, logprobs = generated(llm, prompts, params)
    other_tokens = [i for i, (t, _) in enumerate(alone) if t[0] != tokens[i]]
    other_logprobs = [i for i, (_, lp) in enumerate(alone) if lp[0] != logprobs[i]]
    assert not other_tokens and not other_logprobs, \
        f"alone vs together: tokens differ for prompts {other_tokens}, logprobs for {other_logprobs}; seed {seed}"
    cached = LLM(str(model_dir), device="cuda", num_blocks=1200, max_num_seqs=32, batch_invariant=True,
                 enable_prefix_caching=True)
    generated(cached, prompts[:8], params)                     # their full blocks are now in the prefix cache
    assert generated(cached, prompts, params) == (tokens, logprobs), f"prefix cache hits changed bits, seed {seed}"


def test_sampled_alone_and_together_are_the_same_tokens(model_dir):
    """Seeded sampling at temperature 0.8: a request's tokens and logprobs alone equal those it gets among 32 — the
    mode draws its sampled rows together (kernels/sample_rows.cu), each in an order of its own."""
    from tinyvllm import LLM, SamplingParams
    seed = 29
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, DIMS["vocab_size"], int(rng.integers(5, 300))).tolist() for _ in range(32)]
    params = [SamplingParams(temperature=0.8, seed=seed + i, max_tokens=24, ignore_eos=True, logprobs=3)
              for i in range(len(prompts))]
    llm = LLM(str(model_dir), device="cuda", num_blocks=1200, max_num_seqs=32, batch_invariant=True,
              enable_prefix_caching=False)
    alone = [generated(llm, [p], [q]) for p, q in zip(prompts, params)]
    tokens, logprobs = generated(llm, prompts, params)
    other = [i for i, (t, lp) in enumerate(alone) if t[0] != tokens[i] or lp[0] != logprobs[i]]
    assert not other, f"alone vs together: prompts {other} differ; seed {seed}"


def test_running_ahead_gives_the_tokens_of_one_step_at_a_time(model_dir):
    """Async scheduling on the GPU (engine.py): step N + 1's graph replay takes step N's tokens on the device. The
    batch-invariant mode makes a row's numbers independent of the rows beside, so the tokens must be equal bit for bit
    to the engine's one step at a time, through stop tokens, sampling and admissions; and the replays must have been
    fed (a pipeline that never engages fails). Then batch 1 in the default mode, the graph the engine serves."""
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.formats.config import load_config
    path, vocab = model_dir, load_config(model_dir).vocab_size
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 3000, int(rng.integers(5, 200))).tolist() for _ in range(24)]
    params = [SamplingParams(temperature=float(rng.choice([0, 0.8])), top_k=int(rng.choice([0, 20])), seed=i,
                             stop_token_ids=rng.integers(0, vocab, vocab // 20).tolist(),
                             max_tokens=int(rng.integers(1, 60)),
                             ignore_eos=True) for i in range(24)]
    single = [rng.integers(0, 3000, 300).tolist()], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs, fed = {}, {}
    for ahead in (False, True):
        llm = LLM(str(path), device="cuda", num_blocks=400, max_num_seqs=16, batch_invariant=True,
                  async_scheduling=ahead)
        assert llm.engine.runs_ahead == ahead
        graphs, fed[ahead] = llm.engine.runner.graphs, [0]
        feed = graphs._feed
        graphs._feed = lambda n, f, feed=feed, count=fed[ahead]: (count.__setitem__(0, count[0] + 1), feed(n, f))
        outs[ahead] = [(o.token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]
        assert llm.engine.scheduler.block_manager.num_free == 400
        llm.close()
        default = LLM(str(path), device="cuda", num_blocks=400, async_scheduling=ahead)
        outs[ahead].append(default.generate(*single)[0].token_ids)
        default.close()
    assert outs[False] == outs[True]
    assert fed[False] == [0] and fed[True][0] > 20, f"{fed[True][0]} replays were fed"
    assert {reason for _, reason in outs[True][:-1]} == {"stop", "length"}
