"""Chapter 9 exercises: the shard of a weight for one rank, and where the MLP's all-reduce goes.

Both are NumPy on the host and graded on the CPU. Fill them in, then:

    make grade CH=9                   # the graders: a score table
    make chapter-9 IMPL=student       # the chapter's checkpoint, with your functions inside the sharded model
    .venv/bin/python -m pytest tests/test_ch09_exercises.py --impl=student -x
                                      # the graders alone: the first failure, with its traceback

`--impl student` replaces tinyvllm.model.tensor_parallel.shard_weight and .parallel_mlp with yours:
ShardedModel then cuts every weight with your shard_weight, and every layer's MLP runs through your
parallel_mlp, so the checkpoint's comparison with the unsharded model checks them both.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tinyvllm.errors import TinyVLLMError  # noqa: F401  (for your solution)
from tinyvllm.formats.config import LlamaConfig
from tinyvllm.model.backend.numpy_ops import swiglu  # noqa: F401  (for your solution)

REFERENCE = {
    "shard_weight": "tinyvllm.model.tensor_parallel:shard_weight",
    "parallel_mlp": "tinyvllm.model.tensor_parallel:parallel_mlp",
}


def shard_weight(name: str, weight: np.ndarray, cfg: LlamaConfig, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s shard of the engine weight `name`, when the model is split over `world` ranks.

    Exercise 9.1. `name` is one of the engine's weight names (tinyvllm/model/model.py,
    plan_engine_weights), the layer number first: "embed", "lm_head", "final_norm", and for layer i
    "i.input_norm", "i.qkv", "i.o_proj", "i.post_norm", "i.gate_up", "i.down". Every matrix is stored
    (out, in), as in the checkpoint. With H = cfg.num_attention_heads, KVH = cfg.num_key_value_heads,
    D = cfg.head_dim, I = cfg.intermediate_size, V = cfg.vocab_size, h = cfg.hidden_size, rank r gets:

      "i.qkv"      (H D + 2 KVH D, h), rows [Q heads | K heads | V heads], head j in rows j D .. j D + D - 1
                   of its part -> (H D / world + 2 KVH D / world, h): rank r's query heads
                   r H/world .. (r + 1) H/world - 1, then its K heads r KVH/world .., then its V heads,
                   stacked in that order. (Split each part, not the fused matrix: cutting the fused rows
                   into `world` blocks has the same shape and the wrong heads.)
      "i.o_proj"   (h, H D) -> (h, H D / world): the input COLUMNS of rank r's query heads, in order
      "i.gate_up"  (2 I, h), rows [gate | up] -> (2 I / world, h): gate rows r I/world .. (r + 1) I/world - 1,
                   then the up rows of the same indices
      "i.down"     (h, I) -> (h, I / world): the input columns r I/world .. (r + 1) I/world - 1
      "embed", "lm_head"  (V, h) -> (V / world, h): the vocabulary rows r V/world .. (r + 1) V/world - 1
      the norms (h,) -> (h,): the whole vector on every rank (replicated)

    Return a new array of weight's dtype (a copy: on a GPU a rank holds only its shard); `weight` is not changed.
    Raise TinyVLLMError (one line) if `world` does not divide the size the weight is split along (H and
    KVH for qkv and o_proj, I for gate_up and down, V for embed and lm_head), or if rank is not in
    0 .. world - 1. np.split(a, world, axis=...) cuts equal consecutive blocks.
    """
    raise NotImplementedError("Exercise 9.1: shard_weight")


def parallel_mlp(x: list[np.ndarray], gate_up: list[np.ndarray], down: list[np.ndarray], out: list[np.ndarray],
                 all_reduce: Callable[[list[np.ndarray]], None]) -> None:
    """One layer's MLP on N ranks, with ONE all-reduce at the right place.

    Exercise 9.2. Rank r holds:
      x[r]        (T, h) float32: the normed rows entering the MLP, the same numbers on every rank
      gate_up[r]  (2 I/N, h): its shard from Exercise 9.1, rows [its gate rows | its up rows]
      down[r]     (h, I/N): its shard of down, the input columns matching its gate/up rows
      out[r]      (T, h): where its result goes
    The MLP is down(silu(gate x) * up x). Rank r computes, with no help from the others, its I/N columns
    of gate x and up x, then act_r = silu(gate_r x) * (up_r x) (T, I/N), then act_r @ down[r]^T (T, h)
    into out[r]: a partial sum of the output. swiglu(gate_up, act) from numpy_ops computes act_r: it reads
    gate_up, the (T, 2 I/N) product x[r] @ gate_up[r]^T ([gate | up] columns), and WRITES its result into
    act, a (T, I/N) float32 array you make (it returns nothing). Then call all_reduce(out) exactly once: it
    replaces the contents of every out[r] by the sum over the ranks, so afterwards each out[r] holds the
    whole MLP output. Write into the arrays out[r] (out[r][...] = ..., or out=out[r]): they are the ranks'
    buffers, which the next layer reads; `out[r] = ...` would only replace the list's entry.
    Keep float32 (NumPy 2 turns float32 * a float64 scalar into float64). Do not change x or the weights.
    """
    raise NotImplementedError("Exercise 9.2: parallel_mlp")
