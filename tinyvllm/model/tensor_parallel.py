"""Chapter 9: tensor parallelism — one model split over N GPUs (ranks), Megatron-style.

Every rank holds 1/N of every large weight and does 1/N of every layer's work; two all-reduces per layer
put the pieces together. The split follows the layer's two pairs of GEMMs:

    attention  qkv      column-parallel  rank r computes its H/N query heads and KVH/N K/V heads, whole
               o_proj   row-parallel     its heads' input columns -> a partial sum of the output -> all-reduce
    MLP        gate_up  column-parallel  its I/N columns of gate and of up: SwiGLU needs nothing else
               down     row-parallel     its I/N input columns    -> a partial sum of the output -> all-reduce

Nothing moves between the two GEMMs of a pair: what rank r produces (its heads, its slice of the
intermediate) is exactly the input its slice of the second GEMM reads. Weights are stored (out, in), as
in the checkpoint, so a column-parallel GEMM (Megatron's name, for Y = X A with A stored (in, out)) keeps
ROWS of our matrix, and a row-parallel one keeps COLUMNS.

The embedding and the LM head are split by vocabulary: each rank looks up only the ids in its range
(zeros for the others, then an all-reduce) and computes its slice of the logits (then gathered). The
norm weights are small and replicated, and so is the residual stream: every rank holds it whole.

Here the ranks are simulated in one process on the CPU: the shards are NumPy arrays, the all-reduce is a
sum, and the layer loop runs the ranks in lock step with the engine's own NumPy ops. On GPUs each rank
would be a process running its shards, with NCCL all-reduces at the same points.
"""
from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Callable, NamedTuple

import numpy as np

from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.config import LlamaConfig
from tinyvllm.model import buffers
from tinyvllm.model.backend import numpy_ops as ops
from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.model import Layer, Model, plan_engine_weights
from tinyvllm.model.step_plan import SeqStep, step_inputs

F32 = np.float32
SPLIT_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
REPLICATED = ("input_norm", "post_norm", "final_norm")

AllReduce = Callable[[list[np.ndarray]], None]


# ---- the shards ----

def world_sizes(cfg: LlamaConfig) -> list[int]:
    """Every tensor parallel size that splits this model evenly: the divisors of its split sizes' gcd."""
    common = math.gcd(*(getattr(cfg, name) for name in SPLIT_SIZES))
    return [n for n in range(1, common + 1) if common % n == 0]


def check_world_size(cfg: LlamaConfig, world: int) -> None:
    """Each rank gets an equal share of the heads, K/V heads, intermediate and vocabulary, or none at all."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise TinyVLLMError(f"the tensor parallel size must be a positive integer, got {world!r}")
    for name in SPLIT_SIZES:
        if getattr(cfg, name) % world:
            raise TinyVLLMError(f"tensor parallel size {world} does not divide {name}={getattr(cfg, name)}; "
                                f"this model splits into {', '.join(map(str, world_sizes(cfg)))} ranks")


def rank_config(cfg: LlamaConfig, world: int) -> LlamaConfig:
    """The model as one rank sees it: 1/world of the heads, K/V heads, intermediate and vocabulary."""
    check_world_size(cfg, world)
    return replace(cfg, **{name: getattr(cfg, name) // world for name in SPLIT_SIZES})


def split(weight: np.ndarray, dim: int, rank: int, world: int) -> np.ndarray:
    """Block `rank` of `world` equal consecutive blocks of `weight` along `dim`, as a copy: a GPU holds its own."""
    return np.split(weight, world, axis=dim)[rank].copy()


def shard_qkv(weight: np.ndarray, cfg: LlamaConfig, rank: int, world: int) -> np.ndarray:
    """The fused (q + 2 kv, hidden) matrix, rows [Q heads | K heads | V heads] -> the rank's query heads,
    then its K heads, then its V heads. Consecutive heads keep a GQA group on one rank: query heads
    r H/N .. read K/V heads r KVH/N ... Cutting the fused rows into N blocks instead gives the same shape
    and the wrong heads (Llama 3.2 1B over 2 ranks: query heads 0 to 23 on rank 0, and no K or V)."""
    q, k, v = np.split(weight, [cfg.q_size, cfg.q_size + cfg.kv_size])
    return np.concatenate([split(part, 0, rank, world) for part in (q, k, v)])


def shard_gate_up(weight: np.ndarray, cfg: LlamaConfig, rank: int, world: int) -> np.ndarray:
    """The fused (2 inter, hidden) matrix, rows [gate | up] -> the rank's gate rows, then the SAME columns'
    up rows: SwiGLU multiplies silu(gate_i) by up_i, so both must be on one rank."""
    gate, up = np.split(weight, 2)
    return np.concatenate([split(gate, 0, rank, world), split(up, 0, rank, world)])


def shard_weight(name: str, weight: np.ndarray, cfg: LlamaConfig, rank: int, world: int) -> np.ndarray:
    """Rank `rank`'s shard of the engine weight `name` ("embed", "3.qkv", "final_norm", ...; model.py's
    names), for `world` ranks (Exercise 9.1)."""
    check_world_size(cfg, world)
    if not 0 <= rank < world:
        raise TinyVLLMError(f"rank {rank} is not one of the ranks 0 .. {world - 1}")
    kind = name.rsplit(".", 1)[-1]                   # "3.qkv" -> "qkv"
    if kind == "qkv":
        return shard_qkv(weight, cfg, rank, world)
    if kind == "gate_up":
        return shard_gate_up(weight, cfg, rank, world)
    if kind in ("o_proj", "down"):                   # row-parallel: the input columns of its heads / intermediate
        return split(weight, 1, rank, world)
    if kind in ("embed", "lm_head"):                 # its vocabulary rows
        return split(weight, 0, rank, world)
    if kind in REPLICATED:
        return weight.copy()
    raise TinyVLLMError(f"no sharding rule for the weight {name!r}")


# ---- N ranks in one process ----

def plan_rank_buffers(cfg: LlamaConfig, rows: int) -> list[buffers.Region]:
    """One rank's step buffers, float32: the residual stream whole, Q/K/V and attention output of its heads.
    (The MLP's intermediates live inside parallel_mlp.)"""
    h = cfg.hidden_size
    return buffers.lay_out([("residual", (rows, h), "f32"), ("normed", (rows, h), "f32"),
                            ("qkv", (rows, cfg.q_size + 2 * cfg.kv_size), "f32"),
                            ("attn_out", (rows, cfg.q_size), "f32"), ("delta", (rows, h), "f32")])


class Rank:
    """One GPU's part of the model: its shard of every weight, in one blob laid out like a Model's for
    its narrower config, and its own step buffers."""

    def __init__(self, model: Model, index: int, world: int):
        self.index, self.cfg = index, rank_config(model.cfg, world)
        regions = plan_engine_weights(self.cfg, "f32")
        self.weights = buffers.carve(ops.blob(buffers.blob_size(regions)), regions)
        for name, view in self.weights.items():
            shard = shard_weight(name, model.weights[name], model.cfg, index, world)  # Exercise 9.1 plugs in here
            if shard.shape != view.shape:            # a wrong split; view[...] = shard might broadcast it silently
                raise TinyVLLMError(f"the shard of {name} for rank {index} of {world} has shape {shard.shape}; "
                                    f"the rank's {name} is {view.shape}")
            view[...] = shard
        w = self.weights
        self.embed, self.final_norm = w["embed"], w["final_norm"]
        self.lm_head = w.get("lm_head", w["embed"])  # tied: the rank's vocabulary rows serve both
        self.layers = [Layer(*(w[f"{i}.{f.name}"] for f in fields(Layer))) for i in range(self.cfg.num_hidden_layers)]
        regions = plan_rank_buffers(self.cfg, model.max_num_batched_tokens)
        self.buffers = buffers.carve(ops.blob(buffers.blob_size(regions)), regions)

    @property
    def vocab_start(self) -> int:
        """The first token id of this rank's vocabulary range."""
        return self.index * self.cfg.vocab_size


class Collective(NamedTuple):
    op: str        # "all-reduce" or "all-gather"
    after: str     # the weight whose output it completes: "embed", "3.o_proj", "3.down", "lm_head"
    nbytes: int    # the result's size: what every rank ends up holding


class ShardedModel:
    """A CPU Model split over `world` simulated ranks in one process; `collectives` lists what the last
    forward pass communicated."""

    def __init__(self, model: Model, world: int):
        if model.device != "cpu":
            raise TinyVLLMError("the simulated ranks run in NumPy: build the Model with device='cpu'")
        check_world_size(model.cfg, world)
        self.cfg, self.world, self.max_num_batched_tokens = model.cfg, world, model.max_num_batched_tokens
        self.cos, self.sin = model.cos, model.sin    # RoPE tables: replicated
        self.ranks = [Rank(model, r, world) for r in range(world)]
        self.collectives: list[Collective] = []

    def new_pools(self, num_blocks: int) -> list[PagedKVPool]:
        """One paged pool per rank holding only its K/V heads; one plan (block tables, slots) serves all."""
        return [PagedKVPool(rank.cfg, ops, num_blocks) for rank in self.ranks]

    def all_reduce(self, parts: list[np.ndarray], after: str) -> None:
        """NCCL's all-reduce (sum), in place: every rank's array becomes the sum of all ranks' arrays."""
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        for part in parts:
            part[...] = total
        self.collectives.append(Collective("all-reduce", after, total.nbytes))

    def all_gather(self, parts: list[np.ndarray], after: str) -> np.ndarray:
        """The ranks' slices side by side along the last axis (the vocabulary, for the logits)."""
        whole = np.concatenate(parts, axis=-1)
        self.collectives.append(Collective("all-gather", after, whole.nbytes))
        return whole


def row_parallel(x: list[np.ndarray], w: list[np.ndarray], out: list[np.ndarray], all_reduce: AllReduce) -> None:
    """out = x @ W^T for a W split by its input columns: x[r] @ w[r]^T is rank r's partial sum of the
    result, written to out[r]; the all-reduce adds them up on every rank."""
    for xr, wr, o in zip(x, w, out):
        ops.gemm(xr, wr, o)
    all_reduce(out)


def parallel_mlp(x: list[np.ndarray], gate_up: list[np.ndarray], down: list[np.ndarray], out: list[np.ndarray],
                 all_reduce: AllReduce) -> None:
    """One layer's MLP on N ranks, one all-reduce (Exercise 9.2). x[r] (T, hidden): the normed rows, the
    same on every rank; gate_up[r] (2 inter/N, hidden): rank r's gate rows then its up rows; down[r]
    (hidden, inter/N): its input columns of down. Afterwards every out[r] (T, hidden) holds the whole output."""
    acts = []
    for xr, gu in zip(x, gate_up):
        h = np.empty((len(xr), gu.shape[0]), F32)
        ops.gemm(xr, gu, h)                          # column-parallel: its slice of gate and of up
        act = np.empty((len(xr), gu.shape[0] // 2), F32)
        ops.swiglu(h, act)                           # silu(gate_i) * up_i: column i of both is on this rank
        acts.append(act)
    row_parallel(acts, down, out, all_reduce)        # partial sums of down's output, then the all-reduce


def vocab_parallel_embedding(model: ShardedModel, ids: np.ndarray, out: list[np.ndarray]) -> None:
    """Each rank looks up the ids in its vocabulary range and writes zeros for the others; the all-reduce
    adds the one non-zero row of every token."""
    for rank, o in zip(model.ranks, out):
        local = ids - rank.vocab_start
        mine = (local >= 0) & (local < rank.cfg.vocab_size)
        ops.embedding(np.where(mine, local, 0), rank.embed, o)   # row 0 stands in for the others' ids...
        o[~mine] = 0                                             # ...and is wiped
    model.all_reduce(out, "embed")


def run_layers_sharded(model: ShardedModel, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       pools: list[PagedKVPool], attend) -> tuple[list, list]:
    """run_layers (model.py) on every rank in lock step; the all-reduces are where the ranks meet.
    attend(rank, layer, qkv, attn_out) is the attention of that rank's heads. Returns the ranks'
    (residuals, deltas): the same numbers on every rank."""
    T, cfg = len(ids), model.cfg
    if T > model.max_num_batched_tokens:
        raise TinyVLLMError(f"a step of {T} tokens; this model's step buffers hold 1 to "
                            f"{model.max_num_batched_tokens}")
    bufs = [{name: buf[:T] for name, buf in rank.buffers.items()} for rank in model.ranks]
    residual, normed, delta = ([b[name] for b in bufs] for name in ("residual", "normed", "delta"))
    model.collectives = []
    vocab_parallel_embedding(model, ids, residual)
    pending = [None] * model.world                   # the previous MLP's output, not yet added to the residual
    for i in range(cfg.num_hidden_layers):
        layers = [rank.layers[i] for rank in model.ranks]
        for rank, layer, b, pool, p in zip(model.ranks, layers, bufs, pools, pending):
            H, KVH = rank.cfg.num_attention_heads, rank.cfg.num_key_value_heads
            ops.add_rms_norm(b["residual"], p, layer.input_norm, b["normed"], cfg.rms_norm_eps)
            ops.gemm(b["normed"], layer.qkv, b["qkv"])          # column-parallel: this rank's heads only
            ops.rope(b["qkv"], positions, model.cos, model.sin, H + KVH, cfg.head_dim)
            ops.store_kv(b["qkv"], pool.k[i], pool.v[i], slots, H)   # its K/V heads, into its own pool
            attend(rank, i, b["qkv"], b["attn_out"])
        row_parallel([b["attn_out"] for b in bufs], [layer.o_proj for layer in layers], delta,
                     lambda parts: model.all_reduce(parts, f"{i}.o_proj"))
        for layer, b in zip(layers, bufs):
            ops.add_rms_norm(b["residual"], b["delta"], layer.post_norm, b["normed"], cfg.rms_norm_eps)
        parallel_mlp(normed, [layer.gate_up for layer in layers], [layer.down for layer in layers], delta,
                     lambda parts: model.all_reduce(parts, f"{i}.down"))     # Exercise 9.2 plugs in here
        pending = delta
    return residual, delta


def sharded_logits(model: ShardedModel, residual: list, delta: list, rows: np.ndarray) -> np.ndarray:
    """The final norm on every rank (replicated), each rank's vocabulary slice of the logits, and the
    slices gathered: (len(rows), vocab) fp32."""
    parts = []
    for rank, res, d in zip(model.ranks, residual, delta):
        normed = rank.buffers["normed"][:len(rows)]
        ops.add_rms_norm(res[rows], d[rows], rank.final_norm, normed, model.cfg.rms_norm_eps)  # gathered copies
        part = np.empty((len(rows), rank.cfg.vocab_size), F32)
        ops.gemm(normed, rank.lm_head, part)
        parts.append(part)
    return model.all_gather(parts, "lm_head")


def prefill_sharded(model: ShardedModel, pools: list[PagedKVPool], steps: list[SeqStep],
                    all_logits: bool = False) -> np.ndarray:
    """Fresh prompts side by side (prefill_batch's rows): the logits of each prompt's last token,
    (n, vocab) fp32, or of every token with all_logits."""
    if any(s.start for s in steps):
        raise TinyVLLMError("prefill_sharded runs fresh prompts (start 0); a prompt after cached tokens is not sharded yet")
    ends = np.cumsum([len(s.token_ids) for s in steps])
    prompts = [(end - len(s.token_ids), end) for s, end in zip(steps, ends)]

    def attend(rank: Rank, layer: int, qkv, attn) -> None:
        for a, b in prompts:
            ops.prefill_attention(qkv[a:b], attn[a:b], rank.cfg.num_attention_heads, rank.cfg.num_key_value_heads,
                                  rank.cfg.head_dim)

    residual, delta = run_layers_sharded(model, *step_inputs(steps), pools, attend)
    return sharded_logits(model, residual, delta, np.arange(ends[-1]) if all_logits else ends - 1)


def decode_sharded(model: ShardedModel, pools: list[PagedKVPool], steps: list[SeqStep]) -> np.ndarray:
    """One new token per sequence (decode_batch's rows); each rank's query heads read its own pool.
    Returns the next-token logits, (n, vocab) fp32."""
    where = [pool.where(steps, [s.end for s in steps]) for pool in pools]   # the same tables for every rank

    def attend(rank: Rank, layer: int, qkv, attn) -> None:
        pool = pools[rank.index]
        ops.paged_attention(qkv, pool.k[layer], pool.v[layer], *where[rank.index], attn, rank.cfg.num_attention_heads)

    residual, delta = run_layers_sharded(model, *step_inputs(steps), pools, attend)
    return sharded_logits(model, residual, delta, np.arange(len(steps)))
