"""Chapter 7: CUDA graphs for decode — launch a whole step's ~150 kernels with one call.

An eager decode step of a 1B model launches ~150 kernels from Python, each costing the host several
microseconds: at batch 1 the GPU spends more time waiting for launches than computing (bench/decode.py
measures it). A CUDA graph records the launches once and replays them as one unit.

A graph replays the same kernels with the same arguments: the same pointers and the same sizes. So
  - inputs live in static buffers (token ids, positions, slots, block tables, lengths) that each step
    overwrites before the replay, and the logits land in a static output;
  - one graph per batch-size bucket (1, 2, 4, 8, then multiples of 16): a batch of 5 runs the graph of
    8, its 3 padding rows writing to and reading from the pool's scratch block only.
With 256 sequences a step's inputs are also host work: DecodeInputs keeps them in pinned host arrays
that change only where the batch changed, and they go to the GPU in two copies.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.block_manager import BLOCK_SIZE, blocks_for
from tinyvllm.prefill import final_logits, run_layers


def buckets(max_num_seqs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs + 16, 16)) if max_num_seqs > 8 else small + [max_num_seqs]


class DecodeInputs:
    """A decode step's inputs on the host, laid out as the graph's static buffers are on the GPU.

    vectors (4, rows) int32: token ids, positions, slots, lengths; tables (rows, width) int32: row r's
    block table. Rewriting all tables every step costs ~0.5 ms of Python at 256 sequences, so a row is
    written only where it changed: a new sequence in that row, or blocks appended since the last step."""

    def __init__(self, rows: int, width: int, scratch_block: int, empty=np.empty):
        self.vectors, self.tables = empty((4, rows), np.int32), empty((rows, width), np.int32)
        self.scratch_block = scratch_block
        self.written: list[tuple[list, int] | None] = [None] * rows  # per row: (the table list, blocks copied)

    def fill(self, tokens: list[int], seqs: list[int], size: int, cache) -> int:
        """Write this step's inputs for `size` rows (the bucket); returns the table columns in use.
        Appends each sequence's new token to the cache (its slot is an input)."""
        n, pad, tables = len(seqs), size - len(seqs), cache.blocks.tables
        positions = [cache.lengths[s] for s in seqs]            # the new token's position = tokens cached so far
        slots = [cache.append_token(s) for s in seqs]
        self.vectors[:, :size] = [list(tokens) + [0] * pad, positions + [0] * pad,
                                  slots + [self.scratch_block * BLOCK_SIZE] * pad, [p + 1 for p in positions] + [1] * pad]
        for row, s in enumerate(seqs):
            table, done = tables[s], self.written[row]
            # the same list object only ever grows (append_slot, extend); a new object is a new table
            start = done[1] if done is not None and done[0] is table else 0
            if start < len(table):
                self.tables[row, start:len(table)] = table[start:]
            self.written[row] = (table, len(table))
        self.tables[n:size, 0] = self.scratch_block               # padding rows: one token, in the scratch block
        self.written[n:size] = [None] * pad
        return blocks_for(max(positions) + 1)


class GraphedDecode:
    """Called like decode_step(model, tokens, cache, seqs) without the model and cache; same logits."""

    def __init__(self, model, cache, max_num_seqs: int):
        import cupy as cp
        import cupyx
        self.cp, self.model, self.cache = cp, model, cache
        self.buckets = buckets(max_num_seqs)
        rows, width = self.buckets[-1], blocks_for(model.max_model_len)
        self.host = DecodeInputs(rows, width, cache.scratch_block, empty=cupyx.empty_pinned)  # pinned: async copies
        self.vectors, self.tables = cp.zeros((4, rows), np.int32), cp.zeros((rows, width), np.int32)
        self.ids, self.positions, self.slots, self.lengths = self.vectors
        self.logits = cp.empty((rows, model.cfg.vocab_size), np.float32)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.copied = None  # the event after the last copies: the host arrays are not rewritten before it
        self.graphs: dict[int, object] = {}

    def __call__(self, tokens: list[int], seqs: list[int]):
        n = len(tokens)
        size = next(b for b in self.buckets if b >= n)
        if self.copied is not None:
            self.copied.synchronize()
        columns = self.host.fill(tokens, seqs, size, self.cache)
        self.stream.wait_event(self.cp.cuda.get_current_stream().record())  # after the K/V earlier work wrote
        with self.stream:
            self._upload(size, columns)
            self.copied = self.stream.record()
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)
            self.graphs[size].launch(self.stream)
        self.cp.cuda.get_current_stream().wait_event(self.stream.record())  # later work waits for the replay
        return self.logits[:n]

    def _upload(self, size: int, columns: int) -> None:
        """Two copies: all the per-row vectors, and the used columns of the first `size` table rows
        (the table is blocks_for(max_model_len) wide — 8192 for Llama 3.2 — but a step uses a few)."""
        rt = self.cp.cuda.runtime
        self.vectors.set(self.host.vectors, stream=self.stream)
        pitch = self.tables.strides[0]
        rt.memcpy2DAsync(self.tables.data.ptr, pitch, self.host.tables.ctypes.data, pitch, columns * 4, size,
                         rt.memcpyHostToDevice, self.stream.ptr)

    def _capture(self, size: int):
        """Run the step once eagerly (kernels compile, cuBLAS picks its algorithms), then record it."""
        self._run(size)
        self.stream.begin_capture()
        self._run(size)
        return self.stream.end_capture()

    def _run(self, size: int) -> None:
        model, cache, ops, H = self.model, self.cache, self.model.ops, self.model.cfg.num_attention_heads
        tables, lengths = self.tables[:size], self.lengths[:size]

        def attend(layer: int, qkv, attn) -> None:
            ops.paged_attention(qkv, cache.k[layer], cache.v[layer], tables, lengths, attn, H)

        residual, delta = run_layers(model, self.ids[:size], self.positions[:size], self.slots[:size], cache, attend)
        final_logits(model, residual, delta, slice(0, size), out=self.logits[:size])
