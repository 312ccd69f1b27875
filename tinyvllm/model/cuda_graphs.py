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

Which layer a bucket runs is measured, not assumed: where chapter 8's fused layer can run it, the fused step,
the unfused step and the persistent step (the fused layer's instruction list in one launch, persistent.py) are
captured, replayed in turn, and the fastest graph is kept (the three give the same bits; which is fastest
depends on the GPU, the model and the batch size).
"""
from __future__ import annotations

import numpy as np

from tinyvllm.model.decode import decode_batch, decode_rows, uses_fused_layer
from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.persistent import build_program, offers_persistent
from tinyvllm.model.step_plan import BLOCK_SIZE, blocks_for
from tinyvllm.model.model import Model
from tinyvllm.model.step_plan import SeqStep, step_inputs


TIMED_REPLAYS = 10   # per candidate graph of a bucket, alternating: the median decides


def buckets(max_num_seqs: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs + 16, 16)) if max_num_seqs > 8 else small + [max_num_seqs]


class DecodeInputs:
    """A decode step's inputs on the host, laid out as the graph's static buffers are on the GPU.

    vectors (5, rows) int32: token ids, positions, slots, lengths, and where the id is fed from (async scheduling: the
    entry of the step before whose token, drawn on the device, is the row's input; -1: its own id); tables (rows, width)
    int32: row r's block table. Rewriting all tables every step costs ~0.5 ms of Python at 256 sequences, so a row is
    written only where it changed: a new sequence in that row, or blocks appended since the last step."""

    def __init__(self, rows: int, width: int, scratch_block: int, empty=np.empty):
        self.vectors, self.tables = empty((5, rows), np.int32), empty((rows, width), np.int32)
        self.scratch_block = scratch_block
        self.written: list[tuple[list, int] | None] = [None] * rows  # per row: (the table list, blocks copied)

    def fill(self, steps: list[SeqStep], size: int, fed: list[int] | None = None) -> int:
        """Write this step's inputs for `size` rows (the bucket) from the plan, and fed (runner.Feed.rows; None: every
        row's id is its own); returns the table columns in use."""
        n, pad = len(steps), size - len(steps)
        self.vectors[:3, :n] = step_inputs(steps)                 # ids, positions, slots
        self.vectors[3, :n] = [s.end for s in steps]               # lengths: the keys each row attends to
        self.vectors[4, :n] = -1 if fed is None else fed
        self.vectors[:, n:size] = np.array([[0], [0], [self.scratch_block * BLOCK_SIZE], [1], [-1]])  # padding rows
        for row, s in enumerate(steps):
            table, done = s.block_table, self.written[row]
            # the plan hands over the block manager's own list, which only ever grows while the sequence
            # runs: the same object means only its new blocks need writing; another object is a new table
            start = done[1] if done is not None and done[0] is table else 0
            if start < len(table):
                self.tables[row, start:len(table)] = table[start:]
            self.written[row] = (table, len(table))
        self.tables[n:size, 0] = self.scratch_block               # padding rows: one token, in the scratch block
        self.written[n:size] = [None] * pad
        return blocks_for(max(s.end for s in steps))


class GraphedDecode:
    """Called like decode_batch(model, pool, steps) without the model and pool; same logits."""

    def __init__(self, model: Model, pool: PagedKVPool, max_num_seqs: int, layer: str | None = None):
        """layer None: time the graph of every layer that can run a bucket and keep the fastest (the engine's way);
        "unfused", "fused" or "persistent": that layer wherever it can run (a benchmark comparing them)."""
        import cupy as cp
        import cupyx
        self.cp, self.model, self.pool = cp, model, pool
        self.buckets = buckets(max_num_seqs)
        rows, width = self.buckets[-1], blocks_for(model.max_model_len)
        self.host = DecodeInputs(rows, width, pool.scratch_block, empty=cupyx.empty_pinned)  # pinned: async copies
        self.vectors, self.tables = cp.zeros((5, rows), np.int32), cp.zeros((rows, width), np.int32)
        self.ids, self.positions, self.slots, self.lengths, self.fed = self.vectors
        self.logits = cp.empty((rows, model.cfg.vocab_size), np.float32)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.copied = None  # the event after the last copies: the host arrays are not rewritten before it
        self.graphs: dict[int, object] = {}
        self.layer = layer
        self.timings: dict[int, dict[str, float]] = {}   # bucket -> ms per replay of each candidate layer
        self.chosen: dict[int, str] = {}                 # bucket -> the layer its graph runs
        self.programs: dict[int, object] = {}   # bucket -> its persistent step (its graph launches it)
        self.feed_kernel = None                 # compiled on the first fed step (async scheduling)

    def takes(self, rows: int) -> bool:
        """Whether a step of this many rows replays a graph (more rows, e.g. verifications of k + 1 rows: eagerly)."""
        return rows <= self.buckets[-1]

    def __call__(self, steps: list[SeqStep], feed=None):
        """feed (runner.Feed): the step's inputs still on the device, written over the PENDING_TOKEN ids before the
        replay (async scheduling)."""
        n = len(steps)
        if not self.takes(n):
            return decode_batch(self.model, self.pool, steps)
        size = next(b for b in self.buckets if b >= n)
        if self.copied is not None:
            self.copied.synchronize()
        columns = self.host.fill(steps, size, None if feed is None else feed.rows)
        self.stream.wait_event(self.cp.cuda.get_current_stream().record())  # after the K/V earlier work wrote
        with self.stream:
            self._upload(size, columns)
            if feed is not None:
                self._feed(n, feed)
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

    def _feed(self, n: int, feed) -> None:
        """ids[j] = feed.tokens[fed[j]] where fed[j] >= 0: the step ahead's tokens, never seen by the host. One
        elementwise kernel on the replay's stream, after the upload (which wrote PENDING_TOKEN and fed there) and after
        the sampling that drew them (the stream waited for the current one); Feed.on_host is its twin."""
        if self.feed_kernel is None:
            self.feed_kernel = self.cp.ElementwiseKernel("int32 fed, raw T tokens", "int32 id",   # T: int32 or int64
                                                         "if (fed >= 0) id = (int)tokens[fed];", "feed_tokens")
        self.feed_kernel(self.fed[:n], feed.tokens, self.ids[:n])

    def layers(self, size: int) -> list[str]:
        """The layers that can run a bucket: the fused layer's range (uses_fused_layer) adds the fused and, where the
        backend offers it, the persistent step to the unfused layer."""
        if not uses_fused_layer(self.model, size):
            return ["unfused"]
        return ["fused", "unfused"] + (["persistent"] if offers_persistent(self.model.ops) else [])

    def _capture(self, size: int):
        """The bucket's graph: the fastest of the layers that can run it, or the one asked for."""
        layers = self.layers(size)
        if self.layer is not None or len(layers) == 1:
            self.chosen[size] = self.layer if self.layer in layers else layers[0]
            return self._record(size, self.chosen[size])
        graphs = {layer: self._record(size, layer) for layer in layers}
        self.timings[size] = self._time(graphs)
        self.chosen[size] = min(self.timings[size], key=self.timings[size].get)
        return graphs[self.chosen[size]]

    def _record(self, size: int, layer: str):
        """Run the step once eagerly (kernels compile, cuBLAS picks its algorithms), then record it."""
        self._run(size, layer)
        self.stream.begin_capture()
        self._run(size, layer)
        return self.stream.end_capture()

    def _time(self, graphs: dict) -> dict[str, float]:
        """Median ms per replay of each graph, replayed in turn. Replays rewrite this step's K/V with the same
        values (the layers give the same bits), so timing on the live step's inputs is harmless."""
        times = {name: [] for name in graphs}
        for _ in range(TIMED_REPLAYS):
            for name, graph in graphs.items():
                start = self.stream.record()
                graph.launch(self.stream)
                end = self.stream.record()
                end.synchronize()
                times[name].append(self.cp.cuda.get_elapsed_time(start, end))
        return {name: float(np.median(t)) for name, t in times.items()}

    def _run(self, size: int, layer: str) -> None:
        model, pool, ops, H = self.model, self.pool, self.model.ops, self.model.cfg.num_attention_heads
        ids, positions, slots = self.ids[:size], self.positions[:size], self.slots[:size]
        tables, lengths, logits = self.tables[:size], self.lengths[:size], self.logits[:size]
        if layer == "persistent":   # one program per bucket, encoded once: the graph's launch reads its address
            if size not in self.programs:
                self.programs[size] = ops.persistent_program(
                    build_program(model, ids, positions, slots, pool, tables, lengths, logits))
            ops.decode_persistent(self.programs[size])
            return

        def attend(layer: int, qkv, attn) -> None:
            ops.paged_attention(qkv, pool.k[layer], pool.v[layer], tables, lengths, attn, H)

        decode_rows(model, ids, positions, slots, pool, attend, out=logits, fused=layer == "fused")
