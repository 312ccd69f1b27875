"""`make chapter-9`: the default model split over simulated ranks, against the same model unsplit.

    make chapter-9                  # python -m chapters 9: on the CPU, whatever the machine
    make chapter-9 IMPL=student     # the same, with your shard_weight (9.1) and parallel_mlp (9.2) in ShardedModel

The ranks are simulated in one process, in NumPy: every rank's shards are arrays, the all-reduce is a sum.
(Real GPUs talking over NCCL are not part of this chapter yet.) The program prints one rank's shard of every
kind of weight, then answers a chat prompt greedily on the Model and on ShardedModels of 1 and 3 ranks, from
the same step plans. Then the checks:
  (a) every step's logits within TOLERANCE of the Model's (relative error), the same greedy tokens;
  (b) one decode step's collectives: an all-reduce after the embedding, after every o_proj and every down,
      then one gather of the logits, nothing else;
  (c) a tiny random model with 8 heads and 4 K/V heads, split 2 and 4 ways (the default model's 9 heads
      split only 1 or 3 ways, and a size of 2 must be refused).
ShardedModel calls shard_weight and parallel_mlp through their module, so with --impl student yours run.
"""
from __future__ import annotations

import tempfile
from typing import Callable

import numpy as np

from chapters.ch01_map.checkpoint import Stage, rel_err, timed
from chapters.ch03_prefill.checkpoint import print_table
from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.checkpoints import resolve_model, synth_model
from tinyvllm.formats.tokenizer import load_tokenizer
from tinyvllm.model import tensor_parallel
from tinyvllm.model.decode import decode_batch
from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill_batch

PROMPT = "What is the capital of France?"
NEW_TOKENS = 8
WORLDS = (1, 3)        # SmolLM2's 9 heads and 3 K/V heads split 1 or 3 ways
TINY_WORLDS = (2, 4)
TINY_DIMS = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                 intermediate_size=128)
# float32 relative error vs the Model: the ranks' partial sums add up in another order than one GEMM's. A
# random model stays near 5e-7; the trained one has a residual dimension hundreds of times larger than the
# others, the final norm divides by it, and on this prompt one step of the eight reaches 6e-6.
TOLERANCE = {"trained": 1e-4, "random": 1e-5}
NUM_BLOCKS = 8         # 128 slots: the prompt and its answer
MAX_TOKENS = 64

HOW = {  # how each kind of weight is split, and what joins the pieces
    "embed": "vocabulary rows: its ids looked up, zeros elsewhere -> all-reduce",
    "input_norm": "replicated",
    "qkv": "column-parallel: its query heads, its K heads, its V heads",
    "o_proj": "row-parallel: the input columns of its heads -> all-reduce",
    "post_norm": "replicated",
    "gate_up": "column-parallel: its gate rows and the up rows of the same columns",
    "down": "row-parallel: its intermediate columns -> all-reduce",
    "final_norm": "replicated",
    "lm_head": "vocabulary rows: its slice of the logits -> gathered",
}


def megabytes(arrays) -> float:
    return sum(a.nbytes for a in arrays) / 1e6


def print_shards(model: Model, sharded: tensor_parallel.ShardedModel) -> None:
    """Layer 0's weights, the embedding, the final norm and the head: whole, and rank 0's shard."""
    rank = sharded.ranks[0]
    print(f"rank 0 of {sharded.world}: every weight's shard (layer 0 shown; every layer is split the same way)")
    print(f"  {'weight':<13}{'whole':<16}{'rank 0':<16}split")
    for name, shard in rank.weights.items():
        if not name[0].isdigit() or name.startswith("0."):
            print(f"  {name:<13}{str(model.weights[name].shape):<16}{str(shard.shape):<16}{HOW[name.split('.')[-1]]}")
    if model.cfg.tie_word_embeddings:
        print(f"  {'lm_head':<13}{'(tied)':<16}{'(tied)':<16}the embedding's rows: {HOW['lm_head']}")
    print(f"  per rank: {megabytes(rank.weights.values()):.0f} MB of the model's "
          f"{megabytes(model.weights.values()):.0f} MB\n")


def greedy(prefill: Callable, decode: Callable, prompt: list[int], new_tokens: int) -> tuple[list[int], list]:
    """`new_tokens` greedy tokens: a prefill, then decode steps, planned by one block manager. Returns the
    tokens and the logits each came from."""
    blocks = BlockManager(NUM_BLOCKS)
    logits = [prefill([plan_prefill(blocks, 0, prompt)])[0]]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < new_tokens:
        logits.append(decode(plan_decode(blocks, [0], tokens[-1:]))[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def on_model(model: Model, prompt: list[int], new_tokens: int = NEW_TOKENS):
    pool = PagedKVPool(model.cfg, model.ops, NUM_BLOCKS)
    return greedy(lambda plan: prefill_batch(model, pool, plan), lambda plan: decode_batch(model, pool, plan),
                  prompt, new_tokens)


def on_ranks(sharded: tensor_parallel.ShardedModel, prompt: list[int], new_tokens: int = NEW_TOKENS):
    pools = sharded.new_pools(NUM_BLOCKS)   # one per rank, each with its K/V heads; one plan for all
    return greedy(lambda plan: tensor_parallel.prefill_sharded(sharded, pools, plan),
                  lambda plan: tensor_parallel.decode_sharded(sharded, pools, plan), prompt, new_tokens)


def check_against(expected: tuple, got: tuple, name: str, seconds: float, tol: float) -> Stage:
    """(a) every step's logits and the greedy tokens, against the Model's."""
    (tokens, logits), (their_tokens, their_logits) = got, expected
    err = max(rel_err(a, b) for a, b in zip(logits, their_logits))
    same = tokens == their_tokens
    return Stage(name, f"{len(tokens)} tokens", seconds,
                 f"max rel err {err:.1e} over {len(logits)} steps; greedy tokens "
                 f"{'identical' if same else 'differ'}", bool(err < tol and same))


def check_collectives(sharded: tensor_parallel.ShardedModel) -> Stage:
    """(b) what the last decode step communicated, in order."""
    layers, hidden = sharded.cfg.num_hidden_layers, sharded.cfg.hidden_size
    expected = [("all-reduce", "embed")] + [("all-reduce", f"{i}.{w}") for i in range(layers)
                                            for w in ("o_proj", "down")] + [("all-gather", "lm_head")]
    got = [(c.op, c.after) for c in sharded.collectives]
    reduces = sum(op == "all-reduce" for op, _ in got)
    return Stage(f"(b) collectives of a decode step, N={sharded.world}", f"{reduces} all-reduces, 1 gather", 0.0,
                 f"1 (embed) + 2 x {layers} layers (o_proj, down), {hidden * 4:,} bytes per token each"
                 if got == expected else f"{got[:4]}... differs from embed, o_proj, down, ..., lm_head", got == expected)


def check_refused(model: Model, world: int) -> Stage:
    try:
        tensor_parallel.ShardedModel(model, world)
    except TinyVLLMError as e:
        return Stage(f"N={world} on this model", "refused", 0.0, str(e).split(";")[0], True)
    return Stage(f"N={world} on this model", "accepted", 0.0, "expected a refusal", False)


def check_tiny() -> list[Stage]:
    """(c) a random model whose 8 heads and 4 K/V heads split 2 and 4 ways."""
    with tempfile.TemporaryDirectory(prefix="ch9-") as tmp:
        model = Model(synth_model("smollm2-135m", f"{tmp}/tiny", seed=9, **TINY_DIMS), "cpu", MAX_TOKENS)
    prompt = np.random.default_rng(9).integers(0, model.cfg.vocab_size, 20).tolist()
    expected = on_model(model, prompt)
    stages = []
    for world in TINY_WORLDS:
        got, seconds = timed(on_ranks, tensor_parallel.ShardedModel(model, world), prompt)
        stages.append(check_against(expected, got, f"(c) tiny random model, N={world}", seconds, TOLERANCE["random"]))
    return stages


def main() -> bool:
    model_dir = resolve_model("default")
    tok = load_tokenizer(model_dir)
    model, build_s = timed(Model, model_dir, "cpu", MAX_TOKENS)
    cfg = model.cfg
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    which = "yours" if tensor_parallel.shard_weight.__module__.startswith("chapters") else "the engine's"
    print(f"model: {model_dir} ({cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
          f"{cfg.num_key_value_heads} K/V heads of {cfg.head_dim}, intermediate {cfg.intermediate_size}, vocabulary "
          f"{cfg.vocab_size:,})\nranks simulated in one process on the CPU (NumPy); shard_weight and parallel_mlp: "
          f"{which}\nthis model splits into {', '.join(map(str, tensor_parallel.world_sizes(cfg)))} ranks\n")
    stages = [Stage("engine Model on cpu", f"{megabytes(model.weights.values()):.0f} MB of f32 weights", build_s)]
    _, warm_s = timed(on_model, model, prompt, 2)   # wakes the BLAS threads: the times below measure the work
    print(f"warm-up (one prefill, one decode step): {warm_s * 1e3:.0f} ms")
    expected, seconds = timed(on_model, model, prompt)
    stages.append(Stage(f"prefill {len(prompt)} + {NEW_TOKENS - 1} decode steps", f"{NEW_TOKENS} tokens", seconds))
    print(f"prompt: {PROMPT!r} ({len(prompt)} tokens with the chat template), {NEW_TOKENS} greedy tokens\n"
          f"  unsharded -> {tok.decode(expected[0])!r}")
    for world in WORLDS:
        sharded, build_s = timed(tensor_parallel.ShardedModel, model, world)
        got, seconds = timed(on_ranks, sharded, prompt)
        print(f"  N={world}       -> {tok.decode(got[0])!r}")
        stages += [Stage(f"ShardedModel, N={world}", f"{world} x {megabytes(sharded.ranks[0].weights.values()):.0f} MB",
                         build_s),
                   check_against(expected, got, f"(a) the same, N={world}", seconds, TOLERANCE["trained"])]
    print()
    print_shards(model, sharded)
    stages += [check_collectives(sharded), check_refused(model, 2), *check_tiny()]
    print_table(stages)
    ok = all(s.ok is not False for s in stages)
    print("checkpoint 9:", "PASSED" if ok else "FAILED")
    return ok
