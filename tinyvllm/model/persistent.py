"""Chapter 8, last section: the decode step as one persistent kernel that walks an instruction list.

The fused layer (fused.py) cut a layer to ~7 kernels, yet at batch 1 a step still takes ~2x its bandwidth floor:
every kernel boundary is a launch gap, a ramp-up and a tail, and while the small latency-bound kernels run (RoPE,
attention, the merge of its splits) the memory system has nothing to stream. The megakernel design (Hazy Research's
"No Bubbles" for Llama 3.2 1B) removes the boundaries: one launch per step, its blocks resident for the whole step.

Here the step is written down once as a list of instructions: each is one call of the fused layer, recorded by
running run_layers_fused and final_logits_fused with a backend that writes the calls down instead of running them
(Recorder below), so the list IS the fused layer, op for op, with its buffers' addresses fixed — which is what a
CUDA graph needs too (cuda_graphs.py builds one list per batch bucket and captures its one launch):

    embedding | rms_norm_gemv (qkv) | rope_store_kv | paged_attention | merge_splits | gemv_add (o_proj)
              | rms_norm_gemv_swiglu | gemv_add (down) | ... x layers ... | rms_norm_gemv (final norm + lm_head)

The backend turns the list into its own form (persistent_program) and runs it (decode_persistent):
  - CUDA (kernels/decode_persistent.cu): the instructions as rows of int64 words on the GPU; every block runs
    every instruction's share of the work with the fused kernels' own device functions (so the same bits), and
    meets the other blocks at a grid barrier before the next. Before it waits, a block asks L2 for its rows of
    the next projection: the weight stream keeps going through the barriers and the latency-bound ops.
  - NumPy (the twin): the same list, each call run in order by the fused layer's twins.
"""
from __future__ import annotations

from tinyvllm.model.backend.constants import PERSISTENT_OPS
from tinyvllm.model.fused import final_logits_fused, offers_fused_ops, run_layers_fused
from tinyvllm.model.model import Model

Program = list[tuple[str, tuple]]   # (op name in PERSISTENT_OPS, its arguments), in the order the step runs them


class Recorder:
    """A backend stand-in that writes down the calls of the persistent kernel's ops instead of running them, and
    hands every other attribute (xp, the dtype, ...) through to the real backend."""

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def __getattr__(self, name: str):
        if name in PERSISTENT_OPS:
            return lambda *args: self.calls.append((name, args))
        return getattr(self.ops, name)


def offers_persistent(ops) -> bool:
    """Whether this backend can run the step as a persistent kernel (the batch-invariant mode cannot: no fused ops)."""
    return offers_fused_ops(ops) and hasattr(ops, "decode_persistent")


def build_program(model: Model, ids, positions, slots, pool, tables, lengths, out) -> Program:
    """The instruction list of one decode step of len(ids) rows over the paged pool (block tables `tables`, context
    lengths `lengths`), through every layer, its fp32 logits into `out`: the fused layer's calls, written down."""
    recorder, H = Recorder(model.ops), model.cfg.num_attention_heads

    def attend(layer: int, qkv, attn) -> None:
        recorder.paged_attention(qkv, pool.k[layer], pool.v[layer], tables, lengths, attn, H)

    residual = run_layers_fused(model, ids, positions, slots, pool, attend, ops=recorder)
    final_logits_fused(model, residual, slice(0, len(ids)), out, ops=recorder)
    return recorder.calls


def decode_persistent(model: Model, program: Program) -> None:
    """Run a step's instruction list: its backend's form (one launch on a GPU), built once, then run."""
    model.ops.decode_persistent(model.ops.persistent_program(program))
