"""Chapter 8: the arithmetic of a decode step, and the fused kernels' work block by block, in NumPy.

- What a step must move and how fast it could be: step_bytes, floor_ms.
- What each kernel of a step reads, writes and launches, before and after fusion: layer_kernels, step_kernels.
- The fused kernels as a GPU runs them: one call of rms_norm_gemv_block (or rms_norm_gemv_swiglu_block) does
  the work of ONE thread block, from the residual stream, independently of every other block.
  rms_norm_gemv and rms_norm_gemv_swiglu run all the blocks; gemv_add is the NumPy twin of the CUDA
  exercise's kernel (gemv_add.cu).
- decode_fused: a whole decode step on the CPU with the fused layer, for the checkpoint to compare with the
  engine's decode_batch.

These are the course's models of the kernels, written to show how the work is split between blocks. The
engine's own fused kernels are in tinyvllm/model/kernels/fused_decode.cu, launched by run_layers_fused
(tinyvllm/model/fused.py); their NumPy twins in numpy_ops.py compute each op whole. Everything below calls
the exercises through this module's globals, so `--impl student` plugs the learner's functions in.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyvllm.formats.config import LlamaConfig
from tinyvllm.model.backend.constants import GEMV_COLUMNS_PER_BLOCK, MAX_SPLITS, ROWS, SPLIT_MAX_ROWS
from tinyvllm.model.model import Model
from tinyvllm.model.step_plan import SeqStep

F32 = np.float32
BF16_BYTES, F32_BYTES = 2, 4       # weights, activations and K/V are bf16 on the GPU; the residual stream fp32
COLS_PER_BLOCK = GEMV_COLUMNS_PER_BLOCK  # output columns per thread block: one warp each, as the engine's gemv
H200_SMS = 132                     # streaming multiprocessors of an H200 (the bench files' machine.multiprocessors)
NORM_BLOCKS_PER_SM = 2             # the engine's fused norm kernels: at most 2 blocks per SM, each walking many columns


# ---------- Exercises 8.1 and 8.2: what a step must move, and the floor ----------

def weight_bytes(cfg: LlamaConfig, itemsize: int = BF16_BYTES) -> int:
    """The weights a decode step reads: every layer's matrices and two norms, the final norm, and ONE
    vocabulary x hidden table, the LM head (the embedding is looked up one row per token: not counted)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    layer = (cfg.q_size + 2 * cfg.kv_size) * h + h * cfg.q_size + 2 * inter * h + h * inter + 2 * h
    return itemsize * (cfg.num_hidden_layers * layer + h + cfg.vocab_size * h)


def kv_bytes_per_token(cfg: LlamaConfig, itemsize: int = BF16_BYTES) -> int:
    """K and V of one token in every layer."""
    return itemsize * 2 * cfg.num_hidden_layers * cfg.kv_size


def step_bytes(cfg: LlamaConfig, batch: int, context_len: int) -> int:
    """Bytes one decode step of `batch` sequences must read from GPU memory, each sequence's attention
    reading `context_len` tokens of K and V: the bf16 weights once (the whole batch shares them), plus
    every sequence's own K/V."""
    return weight_bytes(cfg) + batch * context_len * kv_bytes_per_token(cfg)


def floor_ms(nbytes: int, bandwidth_gbps: float) -> float:
    """The fastest a step that moves `nbytes` can run: milliseconds at `bandwidth_gbps` (10^9 bytes/s)."""
    return nbytes / (bandwidth_gbps * 1e9) * 1e3


# ---------- Exercises 8.3 and 8.4: the fused kernels, one thread block at a time ----------

def num_blocks(n_cols: int, cols_per_block: int) -> int:
    """Thread blocks in the grid: enough for every output column."""
    return -(-n_cols // cols_per_block)


def block_columns(block: int, cols_per_block: int, n_cols: int) -> slice:
    """Block `block`'s output columns; the last block may get fewer (its spare warps have nothing to do)."""
    start = block * cols_per_block
    return slice(start, min(start + cols_per_block, n_cols))


def normed_rows(residual: np.ndarray, norm_weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of every row, in add_rms_norm's order: x * (1 / sqrt(mean(x^2) + eps)) * weight."""
    mean_sq = np.einsum("ij,ij->i", residual, residual)[:, None] / F32(residual.shape[1])
    return residual * (F32(1) / np.sqrt(mean_sq + F32(eps))) * norm_weight


def rms_norm_gemv_block(residual: np.ndarray, norm_weight: np.ndarray, w: np.ndarray, out: np.ndarray, eps: float,
                        block: int, cols_per_block: int) -> None:
    """Thread block `block` of rms_norm_gemv: its columns of out = rms_norm(residual) @ w.T. Every block
    normalizes the rows itself, from the residual: no block waits for another, and no `normed` buffer."""
    cols = block_columns(block, cols_per_block, w.shape[0])
    out[:, cols] = normed_rows(residual, norm_weight, eps) @ w[cols].T


def rms_norm_gemv_swiglu_block(residual: np.ndarray, norm_weight: np.ndarray, w_gate_up: np.ndarray,
                               act: np.ndarray, eps: float, block: int, cols_per_block: int) -> None:
    """Thread block `block` of rms_norm_gemv_swiglu: its columns j of act = silu(gate_j) * up_j, with gate_j
    from weight row j and up_j from row inter + j of the fused [gate | up] matrix. Both live in the same
    block, so SwiGLU runs in its epilogue and the (T, 2 inter) gate_up buffer is never written."""
    inter = act.shape[1]
    cols = block_columns(block, cols_per_block, inter)
    x = normed_rows(residual, norm_weight, eps)
    gate = x @ w_gate_up[cols].T
    up = x @ w_gate_up[inter + cols.start:inter + cols.stop].T
    with np.errstate(over="ignore"):              # exp(-gate) = inf for gate < -88: silu -> -0, as the kernel
        act[:, cols] = gate / (F32(1) + np.exp(-gate)) * up


def rms_norm_gemv(residual: np.ndarray, norm_weight: np.ndarray, w: np.ndarray, out: np.ndarray, eps: float,
                  cols_per_block: int = COLS_PER_BLOCK) -> None:
    """The whole grid. A GPU promises no order between blocks; these run last to first, so a block that
    relied on another's output would show."""
    for block in reversed(range(num_blocks(w.shape[0], cols_per_block))):
        rms_norm_gemv_block(residual, norm_weight, w, out, eps, block, cols_per_block)


def rms_norm_gemv_swiglu(residual: np.ndarray, norm_weight: np.ndarray, w_gate_up: np.ndarray, act: np.ndarray,
                         eps: float, cols_per_block: int = COLS_PER_BLOCK) -> None:
    """The whole grid of rms_norm_gemv_swiglu, last block first."""
    for block in reversed(range(num_blocks(act.shape[1], cols_per_block))):
        rms_norm_gemv_swiglu_block(residual, norm_weight, w_gate_up, act, eps, block, cols_per_block)


def gemv_add(x: np.ndarray, w: np.ndarray, residual: np.ndarray) -> None:
    """The NumPy twin of gemv_add.cu (Exercise 8.5): residual += x @ w.T. o_proj and down with the residual
    add in the epilogue: the `delta` buffer and the add_rms_norm that used to add it disappear."""
    residual += x @ w.T


# ---------- the fused decode step, on the CPU ----------

def decode_fused(model: Model, pool, steps: list[SeqStep], cols_per_block: int = COLS_PER_BLOCK) -> np.ndarray:
    """decode_batch (tinyvllm/model/decode.py) with the fused layer, on a CPU Model: the next-token logits
    (n, vocab). The residual stream is whole after every kernel, so each layer reads only three of the step
    buffers (qkv, attn_out, mlp_act), never normed, gate_up or delta."""
    cfg, ops, n = model.cfg, model.ops, len(steps)
    H, KVH, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    residual, qkv, attn, act = (model.buffers[name][:n] for name in ("residual", "qkv", "attn_out", "mlp_act"))
    ids, positions, slots = (np.array(column, np.int32) for column in
                             zip(*[(s.token_ids[0], s.start, s.slots[0]) for s in steps]))
    where = pool.where(steps, [s.end for s in steps])
    attention = getattr(ops, pool.attention)

    ops.embedding(ids, model.embed, residual)
    for i, layer in enumerate(model.layers):
        rms_norm_gemv(residual, layer.input_norm, layer.qkv, qkv, eps, cols_per_block)
        ops.rope(qkv, positions, model.cos, model.sin, H + KVH, D)   # rope_store_kv on the GPU: one kernel
        ops.store_kv(qkv, pool.k[i], pool.v[i], slots, H)
        attention(qkv, pool.k[i], pool.v[i], *where, attn, H)
        gemv_add(attn, layer.o_proj, residual)
        rms_norm_gemv_swiglu(residual, layer.post_norm, layer.gate_up, act, eps, cols_per_block)
        gemv_add(act, layer.down, residual)
    logits = np.empty((n, cfg.vocab_size), F32)
    rms_norm_gemv(residual, model.final_norm, model.lm_head, logits, eps, cols_per_block)
    return logits


# ---------- what each kernel of a step moves ----------

@dataclass(frozen=True)
class Kernel:
    """One kernel launch and the bytes it moves through GPU memory, sorted by kind. A value that many of
    its blocks read (the residual rows, a norm weight) counts once: after the first block, L2 serves it."""
    name: str         # the engine's op ("gemm", "add_rms_norm", ...) or the fused kernel's name
    what: str         # its weight or output
    io: str           # what it reads -> what it writes
    weights: int      # bytes of weights read
    kv: int           # bytes of K/V read from or written to the pool
    activations: int  # bytes of activations read and written: the step's buffers and the residual stream
    blocks: int       # thread blocks in its grid: an H200 has 132 SMs to fill

    @property
    def moved(self) -> int:
        return self.weights + self.kv + self.activations


def norm_gemv_blocks(n_cols: int, sms: int = H200_SMS) -> int:
    """The grid of the engine's rms_norm_gemv and rms_norm_gemv_swiglu: a block per 8 columns, but at most
    NORM_BLOCKS_PER_SM per SM; each block normalizes the rows once and then walks many groups of columns."""
    return min(num_blocks(n_cols, COLS_PER_BLOCK), NORM_BLOCKS_PER_SM * sms)


def attention_splits(batch: int, kv_heads: int, sms: int = H200_SMS) -> int:
    """Blocks sharing one sequence's context in paged attention (cuda_ops.paged_attention's rule): split
    only when one block per (sequence, K/V head) would leave most SMs idle."""
    blocks = batch * kv_heads
    if 2 * blocks <= sms and batch <= SPLIT_MAX_ROWS:
        return min(MAX_SPLITS, -(-2 * sms // blocks))
    return 1


def attention_kernels(cfg: LlamaConfig, T: int, context_len: int, splits: int) -> list[Kernel]:
    """Decode attention: each row's query against its sequence's K/V. With splits > 1 each split writes its
    partial output, max and sum (fp32) and merge_splits combines them. The same before and after fusion."""
    q, b = cfg.q_size, BF16_BYTES
    kv = T * context_len * 2 * cfg.kv_size * b
    blocks = cfg.num_key_value_heads * T * splits
    if splits == 1:
        return [Kernel("decode_attention", "attn_out", "q, the pool's K/V -> attn_out", 0, kv, 2 * T * q * b, blocks)]
    partials = T * cfg.num_attention_heads * splits * (cfg.head_dim + 2) * F32_BYTES
    return [Kernel("decode_attention", "split partials", "q, the pool's K/V -> partials", 0, kv, T * q * b + partials,
                   blocks),
            Kernel("merge_splits", "attn_out", "partials -> attn_out", 0, 0, partials + T * q * b,
                   cfg.num_attention_heads * T)]


def layer_kernels(cfg: LlamaConfig, batch: int, context_len: int, fused: bool,
                  splits: int | None = None) -> list[Kernel]:
    """The kernels of one decoder layer at `batch` sequences (one row each), in launch order: the engine
    of chapter 7, or the fused layer. splits: attention's context split (default: the engine's rule on an
    H200). Every layer counts as a middle one (layer 0's first norm has no delta to add: 4 KB less)."""
    T, h, q, kv, inter = batch, cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    qkv_cols, b = q + 2 * kv, BF16_BYTES
    splits = attention_splits(batch, cfg.num_key_value_heads) if splits is None else splits
    residual = T * h * F32_BYTES                   # one pass over the fp32 residual stream
    rope_tables = 2 * T * cfg.head_dim // 2 * F32_BYTES   # cos and sin at each row's position
    attention = attention_kernels(cfg, T, context_len, splits)
    cols = COLS_PER_BLOCK

    if not fused:
        def norm(weight: str) -> Kernel:           # residual += delta; normed = rms_norm(residual)
            return Kernel("add_rms_norm", weight, "residual, delta -> residual, normed", h * b, 0,
                          2 * residual + 2 * T * h * b, T)

        def gemm(weight: str, io: str, rows: int, width: int, k_in: int) -> Kernel:
            return Kernel("gemm", weight, io, rows * width * b, 0, T * (k_in + rows) * b, num_blocks(rows, cols))

        return [norm("input_norm"),
                gemm("qkv", "normed -> qkv", qkv_cols, h, h),
                Kernel("rope", "q, k", "q, k (and cos, sin) -> q, k in place", 0, 0, 2 * T * (q + kv) * b + rope_tables,
                       T),
                Kernel("store_kv", "k, v", "k, v -> the pool", 0, T * 2 * kv * b, T * 2 * kv * b, T),
                *attention,
                gemm("o_proj", "attn_out -> delta", h, q, q),
                norm("post_norm"),
                gemm("gate_up", "normed -> gate_up", 2 * inter, h, h),
                Kernel("swiglu", "mlp_act", "gate_up -> mlp_act", 0, 0, T * 3 * inter * b, num_blocks(T * inter, ROWS)),
                gemm("down", "mlp_act -> delta", h, inter, inter)]
    return [Kernel("rms_norm_gemv", "qkv", "residual -> qkv", (qkv_cols + 1) * h * b, 0, residual + T * qkv_cols * b,
                   norm_gemv_blocks(qkv_cols)),
            Kernel("rope_store_kv", "q, k, v", "qkv (and cos, sin) -> q in place, k and v to the pool", 0,
                   T * 2 * kv * b, T * (qkv_cols + q) * b + rope_tables, T),
            *attention,
            Kernel("gemv_add", "o_proj", "attn_out, residual -> residual", h * q * b, 0, T * q * b + 2 * residual,
                   num_blocks(h, cols)),
            Kernel("rms_norm_gemv_swiglu", "gate_up", "residual -> mlp_act", (2 * inter + 1) * h * b, 0,
                   residual + T * inter * b, norm_gemv_blocks(inter)),
            Kernel("gemv_add", "down", "mlp_act, residual -> residual", h * inter * b, 0, T * inter * b + 2 * residual,
                   num_blocks(h, cols))]


def step_kernels(cfg: LlamaConfig, batch: int, context_len: int, fused: bool,
                 splits: int | None = None) -> list[Kernel]:
    """Every kernel of one decode step: the embedding, the layers, the final norm and the LM head."""
    T, h, vocab, b = batch, cfg.hidden_size, cfg.vocab_size, BF16_BYTES
    residual, logits = T * h * F32_BYTES, T * vocab * F32_BYTES
    embedding = Kernel("embedding", "residual", "the tokens' embedding rows -> residual", T * h * b, 0, residual, T)
    if fused:
        tail = [Kernel("rms_norm_gemv", "lm_head", "residual -> logits", (vocab + 1) * h * b, 0, residual + logits,
                       norm_gemv_blocks(vocab))]
    else:
        tail = [Kernel("add_rms_norm", "final_norm", "residual, delta -> residual, normed", h * b, 0,
                       2 * residual + 2 * T * h * b, T),
                Kernel("gemm", "lm_head", "normed -> logits", vocab * h * b, 0, T * h * b + logits,
                       num_blocks(vocab, COLS_PER_BLOCK))]
    return [embedding, *layer_kernels(cfg, batch, context_len, fused, splits) * cfg.num_hidden_layers, *tail]
