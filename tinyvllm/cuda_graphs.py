"""Chapter 7: CUDA graphs for decode — launch a whole step's ~150 kernels with one call.

An eager decode step of a 1B model launches ~150 kernels from Python, each costing the host several
microseconds: at batch 1 the GPU spends more time waiting for launches than computing (bench/decode.py
measures it). A CUDA graph records the launches once and replays them as one unit.

A graph replays the same kernels with the same arguments: the same pointers and the same sizes. So
  - inputs live in static buffers (token ids, positions, slots, block tables, lengths) that each step
    overwrites before the replay, and the logits land in a static output;
  - one graph per batch-size bucket (1, 2, 4, 8, then multiples of 16): a batch of 5 runs the graph of
    8, its 3 padding rows writing to and reading from the pool's scratch block only.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.block_manager import blocks_for
from tinyvllm.prefill import final_logits, run_layers


def buckets(max_num_seqs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs + 16, 16)) if max_num_seqs > 8 else small + [max_num_seqs]


class GraphedDecode:
    """Called like decode_step(model, tokens, cache, seqs) without the model and cache; same logits."""

    def __init__(self, model, cache, max_num_seqs: int):
        import cupy as cp
        self.cp, self.model, self.cache = cp, model, cache
        self.buckets = buckets(max_num_seqs)
        rows, width = self.buckets[-1], blocks_for(model.max_model_len)
        self.ids, self.positions, self.slots, self.lengths = (cp.zeros(rows, np.int32) for _ in range(4))
        self.tables = cp.zeros((rows, width), np.int32)
        self.logits = cp.empty((rows, model.cfg.vocab_size), np.float32)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graphs: dict[int, object] = {}

    def __call__(self, tokens: list[int], seqs: list[int]):
        n = len(tokens)
        size = next(b for b in self.buckets if b >= n)
        host = self._inputs(tokens, seqs, size)
        self.stream.wait_event(self.cp.cuda.get_current_stream().record())  # after the K/V earlier work wrote
        with self.stream:
            for buffer, values in zip((self.ids, self.positions, self.slots, self.lengths, self.tables), host):
                buffer[:size].set(values, stream=self.stream)
            if size not in self.graphs:
                self.graphs[size] = self._capture(size)
            self.graphs[size].launch(self.stream)
        self.cp.cuda.get_current_stream().wait_event(self.stream.record())  # later work waits for the replay
        return self.logits[:n]

    def _inputs(self, tokens: list[int], seqs: list[int], size: int) -> list[np.ndarray]:
        """This step's inputs as host arrays of `size` rows; padding rows point at the scratch block."""
        cache, scratch, pad = self.cache, self.cache.scratch_block, size - len(tokens)
        positions = [cache.lengths[s] for s in seqs]
        slots = [cache.append_token(s) for s in seqs]
        tables = np.full((size, self.tables.shape[1]), scratch, np.int32)
        used = cache.blocks.block_tables(seqs)
        tables[:len(seqs), :used.shape[1]] = np.where(used < 0, scratch, used)
        lengths = [cache.lengths[s] for s in seqs] + [1] * pad
        as32 = lambda a: np.asarray(a, dtype=np.int32)  # noqa: E731
        return [as32(list(tokens) + [0] * pad), as32(positions + [0] * pad),
                as32(list(slots) + [scratch * 16] * pad), as32(lengths), tables]

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
