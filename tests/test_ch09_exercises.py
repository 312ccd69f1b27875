"""Chapter 9 graders: the shard of a weight for one rank (Exercise 9.1) and the MLP's all-reduce (9.2), on the CPU.

shard_weight is checked on random weights of random small configs against index lists the grader writes
out head by head (a query head's D rows, a K/V head's, a gate row and the up row of the same index, a
vocabulary row), and by what a shard is for: the ranks' partial products of o_proj and down add up to the
whole product. parallel_mlp is checked against the MLP computed whole in float64, on shards the grader cuts
itself, with NaN in every output buffer and an all_reduce that counts its calls. Finally both run inside
the engine's ShardedModel on a tiny random model, whose logits and greedy tokens must be the unsharded
Model's.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np
import pytest

from tests.numeric import check, rel_err, same
from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.checkpoints import PRESETS
from tinyvllm.model import tensor_parallel
from tinyvllm.model.decode import decode_batch
from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill_batch

WORLDS = [1, 2, 3, 4]
KINDS = ["qkv", "o_proj", "gate_up", "down", "embed", "lm_head", "input_norm", "post_norm", "final_norm"]


def small_config(rng, world: int):
    """A config whose heads, K/V heads, intermediate and vocabulary all divide by `world`, GQA 1:1 to 3:1."""
    kv_heads = world * int(rng.integers(1, 3))
    heads = kv_heads * int(rng.integers(1, 4))
    return replace(PRESETS["llama-3.2-1b"], hidden_size=int(rng.integers(3, 9)), num_attention_heads=heads,
                   num_key_value_heads=kv_heads, head_dim=int(rng.choice([2, 4])),
                   intermediate_size=world * int(rng.integers(1, 5)), vocab_size=world * int(rng.integers(2, 6)))


def weight_shape(kind: str, cfg) -> tuple[int, ...]:
    h, q, kv, inter, vocab = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    return {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * inter, h), "down": (h, inter),
            "embed": (vocab, h), "lm_head": (vocab, h)}.get(kind, (h,))


def engine_name(kind: str) -> str:
    return kind if kind in ("embed", "lm_head", "final_norm") else f"3.{kind}"


def expected_shard(kind: str, weight: np.ndarray, cfg, rank: int, world: int) -> np.ndarray:
    """The shard, from index lists written out head by head and row by row."""
    D, H, KVH = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    my_heads = range(rank * H // world, (rank + 1) * H // world)
    my_kv = range(rank * KVH // world, (rank + 1) * KVH // world)
    my_inter = list(range(rank * cfg.intermediate_size // world, (rank + 1) * cfg.intermediate_size // world))
    if kind == "qkv":
        rows = [j * D + d for j in my_heads for d in range(D)]
        rows += [H * D + j * D + d for j in my_kv for d in range(D)]
        rows += [H * D + KVH * D + j * D + d for j in my_kv for d in range(D)]
        return weight[rows]
    if kind == "o_proj":
        return weight[:, [j * D + d for j in my_heads for d in range(D)]]
    if kind == "gate_up":
        return weight[my_inter + [cfg.intermediate_size + i for i in my_inter]]
    if kind == "down":
        return weight[:, my_inter]
    if kind in ("embed", "lm_head"):
        per_rank = cfg.vocab_size // world
        return weight[rank * per_rank:(rank + 1) * per_rank]
    return weight


@pytest.mark.ch9
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", KINDS)
def test_shard_weight_gives_each_rank_its_heads_columns_and_vocabulary(impl, rng, kind, world):
    shard_weight = impl("shard_weight")
    for _ in range(3):
        cfg = small_config(rng, world)
        dtype = rng.choice([np.float32, np.float64])   # a shard keeps its weight's dtype
        weight = rng.standard_normal(weight_shape(kind, cfg)).astype(dtype)
        before = weight.copy()
        for rank in range(world):
            got = shard_weight(engine_name(kind), weight, cfg, rank, world)
            expected = expected_shard(kind, weight, cfg, rank, world)
            what = (f"shard_weight({engine_name(kind)!r}, weight {weight.shape}, rank {rank}, world {world}) with "
                    f"{cfg.num_attention_heads} heads, {cfg.num_key_value_heads} K/V heads of {cfg.head_dim}, "
                    f"intermediate {cfg.intermediate_size}, vocabulary {cfg.vocab_size}")
            assert isinstance(got, np.ndarray), f"{what}: expected a NumPy array, got {type(got).__name__}"
            same(got.shape, expected.shape, f"{what}: the shape")
            same(str(got.dtype), str(weight.dtype), f"{what}: the dtype (the weight's)")
            assert np.array_equal(got, expected), f"{what}: the right shape, the wrong rows or columns"
        assert np.array_equal(weight, before), f"shard_weight({engine_name(kind)!r}) changed the weight it was given"


@pytest.mark.ch9
@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_weight_partial_products_add_up_to_the_whole(impl, rng, world):
    """o_proj and down are row-parallel: rank r's slice of the input times its shard is a partial sum of
    the output, and the ranks' partial sums add up to the whole product."""
    shard_weight = impl("shard_weight")
    cfg = small_config(rng, world)
    for kind, width in (("o_proj", cfg.q_size), ("down", cfg.intermediate_size)):
        x = rng.standard_normal((5, width)).astype(np.float32)
        weight = rng.standard_normal(weight_shape(kind, cfg)).astype(np.float32)
        parts = [shard_weight(f"0.{kind}", weight, cfg, r, world) for r in range(world)]
        inputs = np.split(x, world, axis=1)   # rank r's heads (or intermediate columns), in order
        total = sum(xr.astype(np.float64) @ p.T.astype(np.float64) for xr, p in zip(inputs, parts))
        err = rel_err(total, x.astype(np.float64) @ weight.T.astype(np.float64))
        assert err < 1e-6, f"{kind}: the ranks' partial products add up to the product with relative error {err:.2e}"


def refusal(call: Callable[[], object], what: str) -> str:
    """The message of the TinyVLLMError that call() must raise; any other outcome fails, saying what it was."""
    try:
        call()
    except TinyVLLMError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001  (any other exception is the grader's finding)
        pytest.fail(f"{what}: raised {type(e).__name__} ({e}); expected a TinyVLLMError (raise it yourself, with a "
                    "one-line message)", pytrace=False)
    pytest.fail(f"{what}: returned normally; expected a TinyVLLMError", pytrace=False)


@pytest.mark.ch9
@pytest.mark.parametrize("kind, field", [("qkv", "num_attention_heads"), ("qkv", "num_key_value_heads"),
                                         ("o_proj", "num_attention_heads"), ("gate_up", "intermediate_size"),
                                         ("down", "intermediate_size"), ("embed", "vocab_size"),
                                         ("lm_head", "vocab_size")])
def test_shard_weight_refuses_a_size_that_does_not_divide(impl, rng, kind, field):
    shard_weight = impl("shard_weight")
    world = 2
    cfg = small_config(rng, world)
    cfg = replace(cfg, **{field: getattr(cfg, field) + 1})
    if field == "num_attention_heads":  # keep GQA possible: K/V heads dividing the heads
        cfg = replace(cfg, num_key_value_heads=1, num_attention_heads=3)
    weight = rng.standard_normal(weight_shape(kind, cfg)).astype(np.float32)
    what = (f"shard_weight({engine_name(kind)!r}, weight {weight.shape}, rank 0, world {world}) with {field} = "
            f"{getattr(cfg, field)}, which {world} does not divide")
    message = refusal(lambda: shard_weight(engine_name(kind), weight, cfg, 0, world), what)
    assert "\n" not in message, f"{what}: the message must be one line: {message!r}"


@pytest.mark.ch9
@pytest.mark.parametrize("rank", [-1, 2, 5])
def test_shard_weight_refuses_a_rank_outside_the_world(impl, rng, rank):
    cfg = small_config(rng, 2)
    weight = np.zeros(weight_shape("qkv", cfg), np.float32)
    shard_weight = impl("shard_weight")
    refusal(lambda: shard_weight("0.qkv", weight, cfg, rank, 2), f"shard_weight('0.qkv', rank {rank}, world 2)")


def mlp_float64(x, gate, up, down) -> np.ndarray:
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    g, u = x @ gate.T, x @ up.T
    return (g / (1 + np.exp(-g)) * u) @ down.T


class CountingAllReduce:
    """The grader's all-reduce: sums the ranks' arrays in place, and records each call."""

    def __init__(self):
        self.calls: list[list[tuple]] = []

    def __call__(self, parts: list[np.ndarray]) -> None:
        self.calls.append([p.shape for p in parts])
        total = np.sum([np.asarray(p, np.float64) for p in parts], axis=0)
        for p in parts:
            p[...] = total


def mlp_shards(rng, world: int, T: int, h: int, inter: int):
    """Random gate, up, down; the ranks' inputs (copies of x) and the grader's own shards."""
    x = rng.standard_normal((T, h)).astype(np.float32)
    gate, up = (rng.standard_normal((inter, h)).astype(np.float32) / np.float32(np.sqrt(h)) for _ in range(2))
    down = rng.standard_normal((h, inter)).astype(np.float32) / np.float32(np.sqrt(inter))
    cols = np.split(np.arange(inter), world)
    gate_up = [np.concatenate([gate[c], up[c]]) for c in cols]
    downs = [down[:, c].copy() for c in cols]
    return x, (gate, up, down), [x.copy() for _ in range(world)], gate_up, downs


@pytest.mark.ch9
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("T", [1, 7])
def test_parallel_mlp_gives_every_rank_the_whole_mlp_output(impl, rng, world, T):
    parallel_mlp = impl("parallel_mlp")
    h, inter = int(rng.integers(4, 24)), world * int(rng.integers(1, 12))
    x, (gate, up, down), xs, gate_up, downs = mlp_shards(rng, world, T, h, inter)
    copies = [a.copy() for a in xs + gate_up + downs]
    buffers = [np.full((T, h), np.nan, np.float32) for _ in range(world)]   # NaN: an unwritten element shows
    out = list(buffers)
    all_reduce = CountingAllReduce()
    parallel_mlp(xs, gate_up, downs, out, all_reduce)
    expected = mlp_float64(x, gate, up, down)
    for r in range(world):
        assert out[r] is buffers[r], (
            f"out[{r}] is no longer the rank's buffer: write into it (out[{r}][...] = ..., or np.matmul(..., "
            f"out=out[{r}])); `out[{r}] = ...` replaces the list's entry and leaves the rank's buffer, which the next "
            "layer reads, unwritten")
        check(buffers[r], expected, (T, h), tol=1e-5,
              what=f"out[{r}] of {world} ranks (T={T}, hidden {h}, intermediate {inter})")
    same(len(all_reduce.calls), 1, "calls to all_reduce (one, after down)")
    same(all_reduce.calls[0], [(T, h)] * world, "the shapes all_reduce was given (each rank's partial sum, (T, hidden))")
    assert all(np.array_equal(a, b) for a, b in zip(xs + gate_up + downs, copies)), "parallel_mlp changed its inputs"


@pytest.mark.ch9
def test_parallel_mlp_hands_the_all_reduce_partial_sums(impl, rng):
    """What reaches the all-reduce is each rank's own share, not the whole output N times."""
    world, T, h, inter = 3, 4, 8, 12
    x, (gate, up, down), xs, gate_up, downs = mlp_shards(rng, world, T, h, inter)
    seen = []

    def record(parts):
        seen.extend(p.astype(np.float64) for p in parts)
        CountingAllReduce()(parts)

    parallel_mlp = impl("parallel_mlp")
    parallel_mlp(xs, gate_up, downs, [np.full((T, h), np.nan, np.float32) for _ in range(world)], record)
    cols = np.split(np.arange(inter), world)
    for r, c in enumerate(cols):
        share = mlp_float64(x, gate[c], up[c], down[:, c])
        assert rel_err(seen[r], share) < 1e-5, f"rank {r} handed the all-reduce something other than its partial sum"


@pytest.mark.ch9
def test_sharded_model_on_your_functions_matches_the_model(impl, monkeypatch, tiny_model_dir, rng):
    """Both exercises inside the engine: a tiny random model over 2 ranks, prefill and 4 decode steps."""
    monkeypatch.setattr(tensor_parallel, "shard_weight", impl("shard_weight"))
    monkeypatch.setattr(tensor_parallel, "parallel_mlp", impl("parallel_mlp"))
    model = Model(tiny_model_dir, "cpu", max_num_batched_tokens=64)
    sharded = tensor_parallel.ShardedModel(model, 2)
    blocks = BlockManager(8)
    pool, pools = PagedKVPool(model.cfg, model.ops, 8), sharded.new_pools(8)
    prompt = rng.integers(0, model.cfg.vocab_size, int(rng.integers(5, 40))).tolist()
    plans = [plan_prefill(blocks, 0, prompt)]
    expected, got = prefill_batch(model, pool, plans), tensor_parallel.prefill_sharded(sharded, pools, plans)
    for step in range(5):
        assert rel_err(got, expected) < 1e-5, f"step {step}: logits differ from the unsharded model's"
        token = int(expected[0].argmax())
        same(int(got[0].argmax()), token, f"step {step}: the greedy token")
        plan = plan_decode(blocks, [0], [token])
        expected, got = decode_batch(model, pool, plan), tensor_parallel.decode_sharded(sharded, pools, plan)
