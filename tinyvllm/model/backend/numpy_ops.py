"""The NumPy twins of the CUDA kernels: same names, signatures and buffer layouts, float32 storage.

Each reads its inputs and writes its `out` buffer in place, exactly like the kernel it mirrors
(tinyvllm/model/kernels/<name>.cu), so the engine code above does not know which one it calls. Each is
written here from its kernel, not borrowed from tinyvllm/reference.py: the reference is the independent
oracle the twins (and through them the engine on the CPU) are tested against (tests/test_twins.py).
All arithmetic stays float32: NumPy 2 would promote a float32 array and a NumPy float64 scalar to float64,
so every scalar that meets an array is an np.float32.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.formats.bf16 import bf16_bits_to_float32
from tinyvllm.model.backend.constants import ARGMAX_PIECE, SAMPLE_THREADS, decode_thread_groups
from tinyvllm.model.gemm import gemm_numpy as gemm  # noqa: F401  (part of the backend's interface)
from tinyvllm.model.step_plan import BLOCK_SIZE

F32 = np.float32

xp = np
DTYPE = np.float32  # activations and weights; the GPU stores bf16 bits here


def gemm_invariant(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """gemm for the batch-invariant mode (chapter 7): every row through one and the same BLAS call.

    A BLAS picks its kernel, blocking and thread split from the shape, so a row of x @ w.T can be summed in
    another order at T = 3 than at T = 64, and which orders depends on the CPU and the BLAS build. Here row t
    is copied into a fixed (1, K) scratch row and multiplied into a fixed (1, N) one: the same call, with
    the same shapes, strides and pointers, whatever T is and wherever the row sat, so any deterministic BLAS
    gives it the same bits. At T = 1 it is the default gemm's own call; at T rows it streams w T times.
    """
    row_in, row_out = _scratch("invariant_x", (1, x.shape[1])), _scratch("invariant_y", (1, w.shape[0]))
    for t in range(x.shape[0]):
        row_in[...] = x[t]
        np.matmul(row_in, w.T, out=row_out)
        out[t] = row_out[0]


def gemv(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """kernels/gemv.cu: gemm for a few rows (the kernel streams the weights once; BLAS's gemv does too)."""
    gemm(x, w, out)


def free_cached_memory() -> None:
    """Nothing to do: NumPy gives an array's memory back as soon as its last reference goes."""


def blob(nbytes: int) -> np.ndarray:
    """One aligned allocation to carve named views from (NumPy alone only promises 16 bytes)."""
    from tinyvllm.model.buffers import aligned_empty
    return aligned_empty(nbytes)


def to_device(a: np.ndarray, dtype=None) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=dtype)


def to_host(a: np.ndarray) -> np.ndarray:
    return a


class HostCopy:
    """cuda_ops.HostCopy's twin: on the CPU the array is on the host already."""
    def __init__(self, a: np.ndarray):
        self.host = a

    def result(self) -> np.ndarray:
        return self.host


def upload_weight(a: np.ndarray) -> np.ndarray:
    """A checkpoint tensor (bf16 bits as uint16, or f16/f32) -> this backend's storage: float32."""
    return bf16_bits_to_float32(a) if a.dtype == np.uint16 else a.astype(F32)


def embedding(ids: np.ndarray, table: np.ndarray, residual: np.ndarray) -> None:
    """kernels/embedding.cu: residual[t] = table[ids[t]]."""
    residual[...] = table[ids]


def add_rms_norm(residual: np.ndarray, delta: np.ndarray | None, weight: np.ndarray, out: np.ndarray,
                 eps: float) -> None:
    """kernels/rms_norm.cu: residual[t] += delta[t] in place (no add when delta is None), then
    out[t] = residual[t] * rsqrt(mean(residual[t]^2) + eps) * weight."""
    if delta is not None:
        residual += delta
    mean_sq = np.einsum("ij,ij->i", residual, residual)[:, None] / F32(residual.shape[-1])  # no squared copy
    scale = F32(1) / np.sqrt(mean_sq + F32(eps))                  # (T, 1): the kernel's rsqrtf
    np.multiply(residual, scale, out=out)
    out *= weight


def rope(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, num_heads: int,
         head_dim: int) -> None:
    """kernels/rope.cu: rotate the first num_heads heads of each row (Q heads then K heads) in place.

    Row t uses row positions[t] of the (max_positions, head_dim / 2) cos/sin tables; dim i < head_dim / 2
    pairs with dim i + head_dim / 2 ("rotate half"): (a, b) -> (a cos - b sin, b cos + a sin).
    """
    T, half = len(positions), head_dim // 2
    x = qkv[:, :num_heads * head_dim].reshape(T, num_heads, head_dim)   # a view: rows keep qkv's stride
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]      # (T, 1, half), shared by all heads
    a, b = x[..., :half], x[..., half:]                                 # views: the products below write qkv
    a_sin, b_sin = a * s, b * s      # the two products that need the old a and b; the other two are taken in place
    a *= c
    a -= b_sin                       # a cos - b sin
    b *= c
    b += a_sin                       # b cos + a sin


def prefill_attention(qkv: np.ndarray, out: np.ndarray, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> None:
    """kernels/prefill_attention.cu: causal grouped-query attention over the T rows of qkv.

    Row i = [Q heads | K heads | V heads]; query head h reads K/V head h // (num_heads / num_kv_heads) and
    the keys of rows j <= i: out[i, h] = softmax_j(q_i . k_j / sqrt(head_dim)) v_j, written to columns
    h * head_dim .. (h + 1) * head_dim of out's row i. The kernel goes through the keys in tiles with an
    online softmax; this twin computes the same sums whole.
    """
    T, group = qkv.shape[0], num_heads // num_kv_heads
    q_cols, kv_cols = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_cols].reshape(T, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)           # (KVH, G, T, d)
    k = qkv[:, q_cols:q_cols + kv_cols].reshape(T, num_kv_heads, head_dim).transpose(1, 2, 0)     # (KVH, d, T)
    v = qkv[:, q_cols + kv_cols:q_cols + 2 * kv_cols].reshape(T, num_kv_heads, head_dim).transpose(1, 0, 2)
    scores = q @ k[:, None]                                                                        # (KVH, G, T, T)
    scores *= F32(1 / np.sqrt(head_dim))
    future = np.arange(T)[None, :] > np.arange(T)[:, None]  # (query i, key j): j after i
    np.copyto(scores, F32(-np.inf), where=future)               # broadcast over heads: no index arrays built
    scores -= scores.max(axis=-1, keepdims=True)               # finite: every row sees key 0
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    o = scores @ v[:, None]                                                                        # (KVH, G, T, d)
    out[...] = o.transpose(2, 0, 1, 3).reshape(T, q_cols)


def swiglu(gate_up: np.ndarray, act: np.ndarray) -> None:
    """kernels/swiglu.cu: act[t, i] = silu(gate) * up, gate = gate_up[t, i], up = gate_up[t, inter + i]."""
    inter = act.shape[1]
    assert gate_up.shape[1] == 2 * inter, "gate_up rows are [gate | up], 2 * inter wide"
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    np.negative(gate, out=act)                                 # in act: no temporary for -gate
    with np.errstate(over="ignore"):                           # exp(-gate) = inf for gate < -88: silu -> -0
        np.exp(act, out=act)
    act += F32(1)
    np.divide(gate, act, out=act)                              # silu(g) = g / (1 + exp(-g)), as the kernel
    act *= up


def argmax(logits: np.ndarray, out: np.ndarray) -> None:
    """kernels/argmax.cu's two passes: every row cut into pieces of ARGMAX_PIECE entries, each piece's first maximum,
    then the first piece that holds the row's. NumPy's argmax in both passes: the first index of the maximum, or of
    the first NaN, as the kernel's rule."""
    rows, vocab = logits.shape
    pieces = -(-vocab // ARGMAX_PIECE)
    if vocab % ARGMAX_PIECE:   # a short last piece: padded with -inf, which never wins over a real entry
        padded = np.full((rows, pieces * ARGMAX_PIECE), -np.inf, np.float32)
        padded[:, :vocab] = logits
        logits = padded
    cut = np.ascontiguousarray(logits).reshape(rows, pieces, ARGMAX_PIECE)   # a view when the rows are whole
    best = cut.argmax(axis=2)                                              # (rows, pieces): each piece's winner
    piece = np.take_along_axis(cut, best[:, :, None], axis=2)[:, :, 0].argmax(axis=1)   # the winners' winner
    out[...] = piece * ARGMAX_PIECE + best[np.arange(rows), piece]


def sample_rows(logits: np.ndarray, inv_temperature: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    """out[r]: a token drawn from softmax(logits[r] * inv_temperature[r]) with the uniform number u[r], every sum in
    the kernel's order (kernels/sample_rows.cu): SAMPLE_THREADS slices, each summed in increasing i (a cumsum is
    sequential), their exclusive prefix sums in increasing slice, then the first i past the draw in its slice."""
    rows, vocab = logits.shape
    span = -(-vocab // SAMPLE_THREADS)
    peak = logits.max(axis=1, keepdims=True).astype(np.float64)
    p = np.zeros((rows, SAMPLE_THREADS * span))
    with np.errstate(invalid="ignore"):   # a row of -inf gives NaN here; it answers 0 below
        p[:, :vocab] = np.exp((logits.astype(np.float64) - peak) * inv_temperature[:, None])
    walked = np.cumsum(p.reshape(rows, SAMPLE_THREADS, span), axis=2)       # each slice's running sum
    ends = np.cumsum(walked[:, :, -1], axis=1)                              # P_{t+1}
    starts = np.concatenate([np.zeros((rows, 1)), ends[:, :-1]], axis=1)    # P_t
    target = u * ends[:, -1]
    owner = SAMPLE_THREADS - 1 - np.argmax(((ends > starts) & (starts <= target[:, None]))[:, ::-1], axis=1)
    for r in range(rows):
        if peak[r, 0] == -np.inf:   # every token forbidden: 0, as argmax answers
            out[r] = 0
            continue
        mine, first = walked[r, owner[r]], owner[r] * span
        past = np.flatnonzero(mine > target[r] - starts[r, owner[r]])
        out[r] = first + past[0] if len(past) else first + np.flatnonzero(p[r, first:first + span])[-1]


def store_kv(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray,
             num_heads: int) -> None:
    """Row t's K and V columns (after the num_heads Q heads) -> slot slots[t] of this layer's cache."""
    _, kv_heads, head_dim = k_cache.shape
    q_cols, kv_cols = num_heads * head_dim, kv_heads * head_dim
    k_cache[slots] = qkv[:, q_cols:q_cols + kv_cols].reshape(-1, kv_heads, head_dim)
    v_cache[slots] = qkv[:, q_cols + kv_cols:q_cols + 2 * kv_cols].reshape(-1, kv_heads, head_dim)


# ---- chapter 8: the fused decode layer's twins (kernels/fused_decode.cu). Each is the unfused ops it replaces, in
# their order, on a scratch buffer where the kernel keeps the intermediate on chip: the same float32 operations,
# so the fused layer gives the unfused layer's bits on the CPU.

def rms_norm_gemv(residual: np.ndarray, norm_weight: np.ndarray, w: np.ndarray, out: np.ndarray, eps: float) -> None:
    """out (T, N) = rms_norm(residual) @ w (N, K)^T: add_rms_norm without a delta, then gemm."""
    normed = _scratch("normed", residual.shape)
    add_rms_norm(residual, None, norm_weight, normed, eps)
    gemm(normed, w, out)


def rms_norm_gemv_swiglu(residual: np.ndarray, norm_weight: np.ndarray, w_gate_up: np.ndarray, act: np.ndarray,
                         eps: float) -> None:
    """act (T, inter) = swiglu(rms_norm(residual) @ w_gate_up (2 inter, K)^T): gate and up side by side, as the
    kernel's warp for column j sums weight rows j and inter + j."""
    normed, gate_up = _scratch("normed", residual.shape), _scratch("gate_up", (residual.shape[0], w_gate_up.shape[0]))
    add_rms_norm(residual, None, norm_weight, normed, eps)
    gemm(normed, w_gate_up, gate_up)
    swiglu(gate_up, act)


def gemv_add(x: np.ndarray, w: np.ndarray, residual: np.ndarray) -> None:
    """residual (T, N) += x (T, K) @ w (N, K)^T: gemm, then the add the next add_rms_norm would have done."""
    delta = _scratch("delta", residual.shape)
    gemm(x, w, delta)
    residual += delta


def rope_store_kv(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, k_cache: np.ndarray,
                  v_cache: np.ndarray, slots: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """rope on the Q and K heads of each row, then store_kv: its K and V to slot slots[t]."""
    rope(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim)
    store_kv(qkv, k_cache, v_cache, slots, num_heads)


# ---- chapter 8, last section: the persistent decode step's twin (kernels/decode_persistent.cu, model/persistent.py)

def persistent_program(calls: list[tuple[str, tuple]]) -> list[tuple[str, tuple]]:
    """The backend's form of a step's instruction list: here the list itself (CUDA: int64 words on the GPU)."""
    return list(calls)


def decode_persistent(program: list[tuple[str, tuple]]) -> None:
    """Run the instruction list in order, each instruction by its op's twin: what every block of the kernel does
    in turn, one grid barrier apart."""
    for name, args in program:
        globals()[name](*args)


_SCRATCH: dict[tuple, np.ndarray] = {}   # (role, shape) -> its float32 array, allocated once


def _scratch(role: str, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 array a twin keeps an intermediate in (where its kernel keeps it on chip): allocated once per
    role and shape, aligned as the model's buffers are (buffers.ALIGN), so BLAS takes the same path over it."""
    key = (role, shape)
    if key not in _SCRATCH:
        _SCRATCH[key] = blob(4 * int(np.prod(shape))).view(F32).reshape(shape)
    return _SCRATCH[key]


DECODE_SPLITS = None  # None: as many chunks as the kernel (decode_thread_groups); an int overrides it, to experiment


def decode_attention(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, starts: np.ndarray,
                     lengths: np.ndarray, out: np.ndarray, num_heads: int) -> None:
    """kernels/decode_attention.cu: one new query per row b (qkv[b]'s Q heads) against the keys in slots
    starts[b] .. starts[b] + lengths[b] - 1 of k_cache, v_cache (num_slots, kv_heads, head_dim).

    As the kernel does it: the context is cut into one chunk per thread group of the block
    (constants.decode_thread_groups(head_dim): 32 at head_dim 64, 128 at 16, 8 at 256), each chunk gets its
    own max, sum and output, and the chunks are merged with online softmax's rescaling.
    """
    _, kv_heads, head_dim = k_cache.shape
    for b, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        q = qkv[b, :num_heads * head_dim].reshape(kv_heads, num_heads // kv_heads, head_dim)
        keys = slice(start, start + length)
        out[b] = attend_in_chunks(q, k_cache[keys], v_cache[keys]).reshape(-1)


def attend_in_chunks(q: np.ndarray, k: np.ndarray, v: np.ndarray, splits: int | None = None) -> np.ndarray:
    """q (kv_heads, group, d) — the query heads sharing each K/V head; k, v (L, kv_heads, d). Returns
    (kv_heads, group, d): softmax(q k^T / sqrt(d)) v, computed chunk by chunk and merged.

    Chunk g holds keys g * chunk .. (g + 1) * chunk - 1 with chunk = ceil(L / splits), as thread group g of
    decode_attention_block walks them (kernels/decode_attention.cuh); the trailing chunks may be empty.
    """
    length, kv_heads, d = k.shape
    if splits is None:
        splits = DECODE_SPLITS or decode_thread_groups(d)
    chunk = -(-length // splits)                     # keys per chunk; trailing chunks may be empty
    padded, group = splits * chunk, q.shape[1]
    scores = np.full((kv_heads, group, padded), -np.inf, F32)            # padding keys weigh nothing
    np.matmul(q, k.transpose(1, 2, 0), out=scores[..., :length])
    scores[..., :length] *= F32(1 / np.sqrt(d))
    s = scores.reshape(kv_heads, group, splits, chunk)
    m = s.max(-1)                                    # each chunk's max, per head: -inf for an empty chunk
    p = np.exp(s - np.where(np.isfinite(m), m, F32(0))[..., None])
    total = p.sum(-1)                                # (kv_heads, group, splits)
    v_padded = np.zeros((kv_heads, padded, d), F32)
    v_padded[:, :length] = v.transpose(1, 0, 2)
    acc = p.transpose(0, 2, 1, 3) @ v_padded.reshape(kv_heads, splits, chunk, d)   # (kv_heads, splits, group, d)
    # merge: rescale every chunk to the overall max, then one division
    weight = np.exp(m - m.max(-1, keepdims=True))    # 0 for empty chunks (m = -inf)
    merged = (weight[..., None, :] @ acc.transpose(0, 2, 1, 3))[:, :, 0]           # (kv_heads, group, d)
    return merged / (weight * total).sum(-1)[..., None]


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q (kv_heads, group, d), k, v (L, kv_heads, d) -> (kv_heads, group, d): softmax(q k^T / sqrt(d)) v, the
    keys taken whole. Six NumPy calls and one temporary, the scores: this is the engine's attention on a CPU,
    once per layer per decode row, where each call costs several microseconds once the weights have flushed
    the caches (attend_in_chunks took 230 us a layer of SmolLM2-135M at 150 keys, this 120)."""
    scores = q @ k.transpose(1, 2, 0)                   # BLAS reads k through its strides: no copy
    scores *= F32(1 / np.sqrt(k.shape[-1]))
    scores -= scores.max(-1, keepdims=True)
    np.exp(scores, out=scores)
    return (scores @ v.transpose(1, 0, 2)) / scores.sum(-1, keepdims=True)


def paged_attention(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    lengths: np.ndarray, out: np.ndarray, num_heads: int, splits: int | None = None,
                    split_tokens: int = 0) -> None:
    """kernels/paged_attention.cu: decode_attention, with row b's token t in slot
    block_tables[b, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE (chapter 6). The kernel's thread groups and
    its optional context splits (chapter 7) only change the order of the same sums; the twin sums each row
    whole (attend), whatever `splits` and `split_tokens` say, in the pool's own layout."""
    _, kv_heads, head_dim = k_cache.shape
    queries = qkv[:, :num_heads * head_dim].reshape(-1, kv_heads, num_heads // kv_heads, head_dim)  # row b: (KVH, G, d)
    for b, length in enumerate(lengths.tolist()):
        table = block_tables[b, :-(-length // BLOCK_SIZE)]                # the blocks holding its keys, in order
        out[b] = attend(queries[b], *context_rows(k_cache, v_cache, table, length)).reshape(-1)


def context_rows(k_cache: np.ndarray, v_cache: np.ndarray, table: np.ndarray,
                 length: int) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's first `length` rows of one layer's K and V caches (slots, kv_heads, d), through its block table.
    Blocks that follow each other in the pool (a sequence alone gets them so) are one slice of it: no copy, a layer's
    attention 3.7x faster at 1,000 keys than gathering (bench/cpu_attention.py; tests/test_paged.py takes both
    paths); else whole blocks gathered, then cut."""
    blocks = table.tolist()   # as Python ints: a list compare costs a fifth of np.diff + == + all, at every layer
    first = blocks[0]
    if blocks == list(range(first, first + len(blocks))):   # checked once for K and V: they share the table
        rows = slice(first * BLOCK_SIZE, first * BLOCK_SIZE + length)
        return k_cache[rows], v_cache[rows]
    return tuple(cache.reshape(-1, BLOCK_SIZE, *cache.shape[1:])[table].reshape(-1, *cache.shape[1:])[:length]
                 for cache in (k_cache, v_cache))


def prefill_attention_invariant(qkv: np.ndarray, out: np.ndarray, num_heads: int, num_kv_heads: int,
                                head_dim: int) -> None:
    """prefill_attention for the batch-invariant mode (chapter 7): each query as a decode query against its
    own keys 0 .. i (attend, as paged_attention reads a decode row: its sums grouped by its context alone). The
    whole-prompt twin above groups a row's sums by the prompt's length T, so a prompt cut into other chunks, or a
    prefix from the cache, changed the last bits. One query at a time: slow, and only this mode pays for it."""
    q_cols, kv_cols = num_heads * head_dim, num_kv_heads * head_dim
    k = qkv[:, q_cols:q_cols + kv_cols].reshape(-1, num_kv_heads, head_dim)
    v = qkv[:, q_cols + kv_cols:q_cols + 2 * kv_cols].reshape(-1, num_kv_heads, head_dim)
    _attend_one_by_one(qkv, k, v, 0, out, num_heads)


def chunk_attention_invariant(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                              start: int, out: np.ndarray, num_heads: int) -> None:
    """chunk_attention for the batch-invariant mode: as prefill_attention_invariant, keys read from the pool."""
    t = np.arange(start + qkv.shape[0])
    slots = block_table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    _attend_one_by_one(qkv, k_cache[slots], v_cache[slots], start, out, num_heads)


def _attend_one_by_one(qkv: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, out: np.ndarray,
                       num_heads: int) -> None:
    """Row i is the query at position start + i; k, v (start + T, kv_heads, head_dim) hold its keys and more."""
    _, kv_heads, head_dim = k.shape
    for i in range(qkv.shape[0]):
        q = qkv[i, :num_heads * head_dim].reshape(kv_heads, num_heads // kv_heads, head_dim)
        out[i] = attend(q, k[:start + i + 1], v[:start + i + 1]).reshape(-1)


def chunk_attention(qkv: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                    start: int, out: np.ndarray, num_heads: int) -> None:
    """A chunk of one sequence's prompt (chapter 7): row i of qkv is the query at position start + i, and
    attends causally to the sequence's keys 0 .. start + i, read through its block table (the chunk's own
    K/V were stored there first). On the GPU, the prefill kernel's chunk_attention (kernels/prefill_attention.cu,
    keys read through the block table); here the same sums over a gathered context, 512 queries at a time to
    bound the scores' memory."""
    T, (_, kv_heads, head_dim) = qkv.shape[0], k_cache.shape
    group, t = num_heads // kv_heads, np.arange(start + T)
    slots = block_table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
    k = k_cache[slots].transpose(1, 2, 0)                                   # (KVH, d, L)
    v = v_cache[slots].transpose(1, 0, 2)                                   # (KVH, L, d)
    for a in range(0, T, 512):
        b = min(a + 512, T)
        q = qkv[a:b, :num_heads * head_dim].reshape(b - a, kv_heads, group, head_dim).transpose(1, 2, 0, 3)
        scores = (q @ k[:, None]) * F32(1 / np.sqrt(head_dim))             # (KVH, G, rows, L)
        scores[:, :, np.arange(start + a, start + b)[:, None] < t[None, :]] = -np.inf   # keys after the query
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[a:b] = (scores @ v[:, None]).transpose(2, 0, 1, 3).reshape(b - a, num_heads * head_dim)
