"""Chapter 3: the engine's model on one device, and its one forward pass.

The checkpoint's Q, K and V projections are stacked into one (q + 2 kv, hidden) matrix, and gate and
up into one (2 inter, hidden) matrix, so each takes ONE GEMM whose output lands in one buffer.
On the GPU the weights stay bf16 (uint16 bits); on the CPU they are float32. Same code either way.

The forward pass is run_layers (every layer, over the rows of a step) and final_logits (the rows that
sample). Prefill (chapter 3) and decode (chapter 5) are thin entry points over it that differ only in
how attention reads K and V. One layer, in buffers:

    residual --add_rms_norm--> normed --gemm--> qkv --rope--> qkv --store_kv--> pool
    --attention--> attn_out --gemm--> delta --add_rms_norm (residual += delta)--> normed --gemm-->
    gate_up --swiglu--> mlp_act --gemm--> delta  (added to the residual by the next layer's first norm)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.formats.config import LlamaConfig, load_config, rope_inv_freq
from tinyvllm.model import buffers
from tinyvllm.model.backend import load_backend
from tinyvllm.model.batch_invariant import BatchInvariantOps
from tinyvllm.model.weights import check_model_fits, open_checkpoint


def plan_engine_weights(cfg: LlamaConfig, dtype: str):
    """The engine's weight blob: HF tensors with Q/K/V and gate/up fused, in execution order."""
    h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
    arrays = [("embed", (cfg.vocab_size, h), dtype)]
    for i in range(cfg.num_hidden_layers):
        arrays += [(f"{i}.input_norm", (h,), dtype), (f"{i}.qkv", (qkv, h), dtype),
                   (f"{i}.o_proj", (h, cfg.q_size), dtype), (f"{i}.post_norm", (h,), dtype),
                   (f"{i}.gate_up", (2 * cfg.intermediate_size, h), dtype),
                   (f"{i}.down", (h, cfg.intermediate_size), dtype)]
    arrays.append(("final_norm", (h,), dtype))
    if not cfg.tie_word_embeddings:
        arrays.append(("lm_head", (cfg.vocab_size, h), dtype))
    return buffers.lay_out(arrays)  # through the module: chapter 2's student lay_out plugs in here


def engine_weight_sources(cfg: LlamaConfig) -> dict[str, list[str]]:
    """Which HF tensors (stacked by rows) make each engine weight; lm_head is absent when tied."""
    names = {"embed": ["model.embed_tokens.weight"], "final_norm": ["model.norm.weight"]}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names.update({f"{i}.input_norm": [p + "input_layernorm.weight"],
                      f"{i}.qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
                      f"{i}.o_proj": [p + "self_attn.o_proj.weight"],
                      f"{i}.post_norm": [p + "post_attention_layernorm.weight"],
                      f"{i}.gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                      f"{i}.down": [p + "mlp.down_proj.weight"]})
    if not cfg.tie_word_embeddings:
        names["lm_head"] = ["lm_head.weight"]
    return names


def rope_tables(cfg: LlamaConfig, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, frequency pair), fp32 (num_positions, head_dim / 2).

    Built once per model and shared by prefill and decode, so both rotate a position identically.
    """
    angles = np.outer(np.arange(num_positions, dtype=np.float32), rope_inv_freq(cfg))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@dataclass
class Layer:
    input_norm: object
    qkv: object
    o_proj: object
    post_norm: object
    gate_up: object
    down: object


class Model:
    fused_decode = True  # chapter 8: decode steps of up to GEMV_DECODE_ROWS rows run fused.py's layer; False: run_layers

    def __init__(self, model_dir: str | Path, device: str, max_num_batched_tokens: int,
                 max_model_len: int | None = None, batch_invariant: bool = False):
        """device: "auto", "cpu" or "cuda"; max_num_batched_tokens: a step's tokens, all sequences', the rows of
        every step buffer (no default here: the engine's is EngineConfig's); max_model_len: None for the model's."""
        self.cfg = cfg = load_config(model_dir)
        self.model_dir = Path(model_dir)
        ops = load_backend(device)
        self.device = "cuda" if ops.__name__.endswith("cuda_ops") else "cpu"
        self.batch_invariant = batch_invariant
        self.ops = ops = BatchInvariantOps(ops) if batch_invariant else ops   # chapter 7: same request, same logits
        self.max_model_len = cfg.context_window(max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        dtype = "bf16" if self.device == "cuda" else "f32"
        self.weight_regions = plan_engine_weights(cfg, dtype)
        self.buffer_regions = buffers.plan_buffers(cfg, self.max_num_batched_tokens, dtype)
        tensors = open_checkpoint(model_dir, cfg)  # the files match config.json before its sizes are trusted
        check_model_fits(ops, cfg, self.weight_regions, self.buffer_regions, self.max_model_len)
        self.weights = buffers.carve(ops.blob(buffers.blob_size(self.weight_regions)),
                                    self.weight_regions)
        self._fill_weights(tensors)
        w = self.weights
        self.embed, self.final_norm = w["embed"], w["final_norm"]
        self.lm_head = w.get("lm_head", w["embed"])  # tied: the embedding matrix is the output head
        self.layers = [Layer(*(w[f"{i}.{n}"] for n in ("input_norm", "qkv", "o_proj", "post_norm", "gate_up",
                                                       "down"))) for i in range(cfg.num_hidden_layers)]
        cos, sin = rope_tables(cfg, self.max_model_len)
        self.cos, self.sin = ops.to_device(cos), ops.to_device(sin)
        self.buffers = buffers.carve(ops.blob(buffers.blob_size(self.buffer_regions)),
                                    self.buffer_regions)

    def _fill_weights(self, tensors: dict[str, np.ndarray]) -> None:
        for name, hf_names in engine_weight_sources(self.cfg).items():
            rows = 0                  # stack the HF tensors row after row into the fused view
            for hf in hf_names:
                self.weights[name][rows:rows + tensors[hf].shape[0]] = self.ops.upload_weight(tensors[hf])
                rows += tensors[hf].shape[0]


def run_layers(model: Model, ids, positions, slots, pool, attend, on_layer=None, num_layers: int | None = None):
    """Every layer over the first len(ids) rows of the buffers: token ids[r] at position positions[r],
    its K/V stored to pool slot slots[r]. Prefill and decode differ only in attend(layer, qkv, attn_out).
    Returns (residual, delta): the stream is their sum. on_layer(residual, delta) runs after each layer.
    num_layers: only the first layers (chapter 10's early-exit draft); None: all of them."""
    cfg, ops, T = model.cfg, model.ops, len(ids)
    b = {name: buf[:T] for name, buf in model.buffers.items()}
    residual, normed, qkv, attn, delta = b["residual"], b["normed"], b["qkv"], b["attn_out"], b["delta"]
    H, KVH, D, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    ops.embedding(ids, model.embed, residual)
    pending = None  # the previous MLP's output, not yet added to the residual
    for i, layer in enumerate(model.layers[:num_layers]):
        ops.add_rms_norm(residual, pending, layer.input_norm, normed, eps)
        ops.gemm(normed, layer.qkv, qkv)
        ops.rope(qkv, positions, model.cos, model.sin, H + KVH, D)  # Q and K heads, V untouched
        ops.store_kv(qkv, pool.k[i], pool.v[i], slots, H)  # later steps read them instead of recomputing
        attend(i, qkv, attn)
        ops.gemm(attn, layer.o_proj, delta)
        ops.add_rms_norm(residual, delta, layer.post_norm, normed, eps)
        ops.gemm(normed, layer.gate_up, b["gate_up"])
        ops.swiglu(b["gate_up"], b["mlp_act"])
        ops.gemm(b["mlp_act"], layer.down, delta)
        pending = delta
        if on_layer is not None:
            on_layer(residual, delta)
    return residual, delta


def final_logits(model: Model, residual, delta, rows, out=None):
    """Final norm and lm_head for the rows that sample (a slice, or the row index of each prompt's end);
    into `out` (rows, vocab) fp32 if given (a CUDA graph's static output), else a new array."""
    ops, eps = model.ops, model.cfg.rms_norm_eps
    if isinstance(rows, slice):
        residual, delta, normed = residual[rows], delta[rows], model.buffers["normed"][rows]
    else:  # gathered copies: the add below must not touch the real residual rows (nothing reads them after)
        index = ops.to_device(np.asarray(rows, dtype=np.int64))
        residual, delta, normed = residual[index], delta[index], model.buffers["normed"][:len(rows)]
    ops.add_rms_norm(residual, delta, model.final_norm, normed, eps)
    logits = ops.xp.empty((len(normed), model.cfg.vocab_size), dtype=np.float32) if out is None else out
    ops.gemm(normed, model.lm_head, logits)
    return logits
