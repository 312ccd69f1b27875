"""Chapter 9 on the CPU: tensor parallelism with N simulated ranks in one process (tinyvllm/model/tensor_parallel.py).

- every weight's shards, put back together, give the weight (Q/K/V and gate/up part by part);
- the sharded forward pass (prefill of two prompts, then decode steps of both, each rank's K/V heads in
  its own NaN-filled pool, its step buffers NaN before every step) gives the unsharded Model's logits
  (relative error < 1e-5, float32) and its greedy tokens, for N = 1, 2, 3, 4 on tiny random models
  (tied and untied heads, GQA) and N = 3 on the default model (9 heads, 3 K/V heads);
- 2 all-reduces per layer (after o_proj and after down), 1 for the embedding, 1 gather of the logits;
- a wrong shard is caught: by the comparison when its shape is right, by ShardedModel when it is not;
- tensor parallel sizes that do not divide the heads, K/V heads, intermediate or vocabulary are refused
  in one line.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests import seeding
from tests.numeric import rel_err
from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.checkpoints import PRESETS, synth_model
from tinyvllm.formats.tokenizer import load_tokenizer
from tinyvllm.model import tensor_parallel
from tinyvllm.model.decode import decode_batch
from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill_batch
from tinyvllm.model.tensor_parallel import (ShardedModel, check_world_size, decode_sharded, prefill_sharded,
                                            rank_config, shard_weight, split, world_sizes)

# heads, K/V heads, intermediate and vocabulary (Llama 3's 128,256) all divide by 1, 2, 3 and 4; GQA 2:1;
# an untied LM head, so the embedding and the head are sharded separately
TP_DIMS = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=24, num_key_value_heads=12, head_dim=16,
               intermediate_size=96)
NUM_BLOCKS = 12
DECODE_STEPS = 4
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tp_model_dir(tmp_path_factory, request):
    """A random-weight Llama 3.1-shaped checkpoint (TP_DIMS), its seed recorded and printed on failure."""
    seed = seeding.seed_for_request(request, "tp_model_dir")
    return synth_model("llama-3.1-8b", tmp_path_factory.mktemp("tp") / "llama", seed=seed, **TP_DIMS)


@pytest.fixture(scope="module")
def models(tp_model_dir, tiny_model_dir):
    """{name: Model}: the TP_DIMS model, and conftest's tiny SmolLM2 (4 heads, 2 K/V heads, tied head)."""
    return {"tp": Model(tp_model_dir, "cpu", max_num_batched_tokens=64), "tiny": Model(tiny_model_dir, "cpu", max_num_batched_tokens=64)}


def poison(sharded: ShardedModel) -> None:
    """NaN in every rank's step buffers: a row a step forgets to write shows in the logits."""
    for rank in sharded.ranks:
        for buf in rank.buffers.values():
            buf[...] = np.nan


def compare(model: Model, sharded: ShardedModel, prompts: list[list[int]], steps: int = DECODE_STEPS) -> None:
    """Prefill the prompts together, then decode all of them `steps` times, on the Model and on the
    ShardedModel from the same plans (one block manager: the same blocks in every pool). Asserts at every
    step: logits within TOLERANCE, the same greedy tokens; each rank's pool holds its K/V heads of the
    Model's pool."""
    blocks = BlockManager(NUM_BLOCKS)
    pool, pools = PagedKVPool(model.cfg, model.ops, NUM_BLOCKS), sharded.new_pools(NUM_BLOCKS)
    for p in pools:                                   # a slot no one wrote is NaN: reading it shows
        p.k[...], p.v[...] = np.nan, np.nan
    plans = [plan_prefill(blocks, seq, ids) for seq, ids in enumerate(prompts)]
    expected = prefill_batch(model, pool, plans, all_logits=True)
    poison(sharded)
    got = prefill_sharded(sharded, pools, plans, all_logits=True)
    last = np.cumsum([len(p) for p in prompts]) - 1
    check_step(got, expected, "prefill (every position)", got[last], expected[last])
    tokens = expected[last].argmax(-1).tolist()
    for step in range(1, steps + 1):
        plan = plan_decode(blocks, list(range(len(prompts))), tokens)
        expected = decode_batch(model, pool, plan)
        poison(sharded)
        got = decode_sharded(sharded, pools, plan)
        check_step(got, expected, f"decode step {step}", got, expected)
        tokens = expected.argmax(-1).tolist()
    check_pools(pool, pools, model.cfg.num_key_value_heads // sharded.world, blocks)


def check_step(got, expected, what: str, got_next, expected_next) -> None:
    assert got.dtype == np.float32 and got.shape == expected.shape, f"{what}: {got.dtype} {got.shape}"
    assert np.isfinite(got).all(), f"{what}: NaN in the sharded logits (an unwritten buffer or pool slot was read)"
    err = rel_err(got, expected)
    assert err < TOLERANCE, f"{what}: sharded logits differ from the Model's, relative error {err:.2e}"
    assert got_next.argmax(-1).tolist() == expected_next.argmax(-1).tolist(), f"{what}: greedy tokens differ"


def check_pools(pool: PagedKVPool, pools: list[PagedKVPool], kv_per_rank: int, blocks: BlockManager) -> None:
    """Rank r's pool holds K/V heads r * kv_per_rank ... of the Model's pool, in the same slots."""
    slots = np.concatenate([blocks.slot_mapping(seq, 0, n) for seq, n in blocks.lengths.items()])
    for r, p in enumerate(pools):
        heads = slice(r * kv_per_rank, (r + 1) * kv_per_rank)
        for mine, whole in ((p.k, pool.k), (p.v, pool.v)):
            assert rel_err(mine[:, slots], whole[:, slots, heads]) < TOLERANCE, f"rank {r}'s pool"


def prompts_for(rng, cfg) -> list[list[int]]:
    return [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(5, 30, size=2)]


# ---------------------------------------------------------------- the shards

def test_world_sizes_are_the_common_divisors():
    assert world_sizes(PRESETS["smollm2-135m"]) == [1, 3]      # 9 heads, 3 K/V heads
    assert world_sizes(PRESETS["llama-3.2-1b"]) == [1, 2, 4, 8]
    assert world_sizes(PRESETS["llama-3.1-8b"]) == [1, 2, 4, 8]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_put_back_together_give_every_weight(models, world):
    model = models["tp"]
    cfg = model.cfg
    rc = rank_config(cfg, world)
    for name, weight in model.weights.items():
        shards = [shard_weight(name, weight, cfg, r, world) for r in range(world)]
        kind = name.rsplit(".", 1)[-1]
        if kind == "qkv":   # each rank: [its Q heads | its K heads | its V heads]
            parts = [np.split(s, [rc.q_size, rc.q_size + rc.kv_size]) for s in shards]
            whole = np.concatenate([np.concatenate([p[i] for p in parts]) for i in range(3)])
        elif kind == "gate_up":
            parts = [np.split(s, 2) for s in shards]
            whole = np.concatenate([np.concatenate([p[i] for p in parts]) for i in range(2)])
        elif kind in ("o_proj", "down"):
            whole = np.concatenate(shards, axis=1)
        elif kind in ("embed", "lm_head"):
            whole = np.concatenate(shards, axis=0)
        else:
            assert all(np.array_equal(s, weight) for s in shards), f"{name}: replicated on every rank"
            continue
        np.testing.assert_array_equal(whole, weight, err_msg=name)
        assert all(not np.shares_memory(s, weight) for s in shards), f"{name}: a shard is a copy, as on its own GPU"


def test_rank_config_is_the_model_divided():
    rc = rank_config(replace(PRESETS["llama-3.2-1b"], vocab_size=128256), 4)
    assert (rc.num_attention_heads, rc.num_key_value_heads, rc.intermediate_size, rc.vocab_size) == (8, 2, 2048, 32064)
    assert (rc.hidden_size, rc.head_dim, rc.num_hidden_layers) == (2048, 64, 16)   # not split


@pytest.mark.parametrize("field", ["num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_size_that_does_not_divide_is_refused_in_one_line(field, world):
    sizes = dict(num_attention_heads=2 * world, num_key_value_heads=world, intermediate_size=8 * world,
                 vocab_size=10 * world)
    cfg = replace(PRESETS["llama-3.2-1b"], **{**sizes, field: sizes[field] + 1})   # only `field` is off by one
    with pytest.raises(TinyVLLMError, match=f"^tensor parallel size {world} does not divide {field}=") as e:
        check_world_size(cfg, world)
    assert "\n" not in str(e.value)
    with pytest.raises(TinyVLLMError, match=field):
        shard_weight("final_norm", np.ones(cfg.hidden_size, np.float32), cfg, 0, world)


def test_the_default_models_nine_heads_do_not_split_in_two():
    cfg = PRESETS["smollm2-135m"]
    with pytest.raises(TinyVLLMError) as e:
        rank_config(cfg, 2)
    assert str(e.value) == ("tensor parallel size 2 does not divide num_attention_heads=9; "
                            "this model splits into 1, 3 ranks")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(TinyVLLMError, match="positive integer"):
            check_world_size(cfg, bad)
    with pytest.raises(TinyVLLMError, match="rank 3 is not one of the ranks 0 .. 2"):
        shard_weight("final_norm", np.ones(cfg.hidden_size, np.float32), cfg, 3, 3)
    with pytest.raises(TinyVLLMError, match="no sharding rule for the weight 'rotary'"):
        shard_weight("rotary", np.ones(4, np.float32), cfg, 0, 3)


# ---------------------------------------------------------------- the sharded forward pass

@pytest.mark.parametrize("name, world", [("tiny", 1), ("tiny", 2), ("tp", 1), ("tp", 2), ("tp", 3), ("tp", 4)])
def test_sharded_forward_matches_the_model(models, name, world, rng):
    model = models[name]
    sharded = ShardedModel(model, world)
    compare(model, sharded, prompts_for(rng, model.cfg))
    collectives = sharded.collectives                           # what the last decode step communicated
    layers = model.cfg.num_hidden_layers
    expected = [("all-reduce", "embed")] + [("all-reduce", f"{i}.{w}") for i in range(layers) for w in ("o_proj", "down")]
    assert [(c.op, c.after) for c in collectives] == expected + [("all-gather", "lm_head")]
    hidden, rows = model.cfg.hidden_size, 2   # the last step decoded two sequences: one row each
    assert all(c.nbytes == rows * hidden * 4 for c in collectives[:-1]), "an all-reduce moves hidden floats per token"
    assert collectives[-1].nbytes == rows * model.cfg.vocab_size * 4


def test_sharded_forward_on_the_default_model(default_model_dir):
    """SmolLM2-135M: 9 query heads and 3 K/V heads over 3 ranks, one K/V head each, on a chat prompt.

    A real prompt, not random ids: the trained model's residual stream has one dimension hundreds of
    times larger than the rest, the final norm divides by it, and on some random id sequences the
    rounding of the ranks' partial sums (the residual agreeing to 2e-6) reaches 1.5e-5 in the logits."""
    model = Model(default_model_dir, "cpu", max_num_batched_tokens=64)
    ids = load_tokenizer(default_model_dir).apply_chat_template([{"role": "user", "content": "Name a color."}])
    compare(model, ShardedModel(model, 3), [ids], steps=3)


def test_every_rank_holds_one_share_of_the_weights(models):
    model = models["tp"]
    sharded = ShardedModel(model, 4)
    whole = sum(w.nbytes for w in model.weights.values())
    norms = sum(w.nbytes for n, w in model.weights.items() if n.endswith("norm"))
    for rank in sharded.ranks:
        mine = sum(w.nbytes for w in rank.weights.values())
        assert mine == (whole - norms) // 4 + norms


def test_a_model_on_the_gpu_is_refused(models, monkeypatch):
    monkeypatch.setattr(models["tiny"], "device", "cuda")
    with pytest.raises(TinyVLLMError, match="device='cpu'"):
        ShardedModel(models["tiny"], 2)


# ---------------------------------------------------------------- a wrong shard is caught

def misplaced(kind: str, wrong):
    """shard_weight with the rule for one kind of weight replaced by `wrong`."""
    def shard(name, weight, cfg, rank, world):
        if name.rsplit(".", 1)[-1] == kind:
            return wrong(weight, cfg, rank, world)
        return shard_weight(name, weight, cfg, rank, world)
    return shard


WRONG_SHARDS = {  # the mistake: what catches it
    "o_proj split by its output rows": ("o_proj", lambda w, cfg, r, n: split(w, 0, r, n), TinyVLLMError),
    "down split by its output rows": ("down", lambda w, cfg, r, n: split(w, 0, r, n), TinyVLLMError),
    "embed replicated, not split": ("embed", lambda w, cfg, r, n: w.copy(), TinyVLLMError),
    "qkv cut into N blocks of rows": ("qkv", lambda w, cfg, r, n: split(w, 0, r, n), AssertionError),
    "gate_up cut into N blocks of rows": ("gate_up", lambda w, cfg, r, n: split(w, 0, r, n), AssertionError),
    "o_proj columns taken every N-th": ("o_proj", lambda w, cfg, r, n: w[:, r::n].copy(), AssertionError),
    "down: the next rank's columns": ("down", lambda w, cfg, r, n: split(w, 1, (r + 1) % n, n), AssertionError),
    "lm_head: the vocabulary in reverse rank order": ("lm_head", lambda w, cfg, r, n: split(w, 0, n - 1 - r, n),
                                                      AssertionError),
}


@pytest.mark.parametrize("mistake", WRONG_SHARDS)
def test_a_wrong_shard_is_detected(models, monkeypatch, rng, mistake):
    kind, wrong, caught_by = WRONG_SHARDS[mistake]
    model = models["tp"]
    monkeypatch.setattr(tensor_parallel, "shard_weight", misplaced(kind, wrong))
    with pytest.raises(caught_by, match=kind if caught_by is TinyVLLMError else "relative error|greedy|rank"):
        compare(model, ShardedModel(model, 2), prompts_for(rng, model.cfg), steps=1)
