"""`make chapter-8`: a decode step's bytes and floor, and the fused layer, checked on the CPU.

    make chapter-8                  # python -m chapters 8: on the CPU, whatever the machine
    make chapter-8 IMPL=student     # the same, with your step_bytes, floor_ms and thread blocks (8.1 to 8.4)

No GPU is needed: the H200 numbers come from the recorded run, bench/results/decode-20261130-004843.json.
  (a) step_bytes for Llama 3.2 1B at batch 1 and context 512 against the bytes bench/decode.py counted from
      the engine's weight blob on the H200, and floor_ms against that run's floor;
  (b) the kernels of a layer and of a step, before and after fusion (fusion.layer_kernels);
  (c) each fused op on layer 0's real weights of the default model, 3 rows, against the engine's unfused
      sequence (add_rms_norm, gemm, swiglu, the residual add), its thread blocks run last to first;
  (d) the whole fused decode step (fusion.decode_fused): the chat prompt answered greedily, 8 tokens, every
      step's logits against the engine's decode_batch from the same plans.
Everything runs through chapters/ch08_fusion/fusion.py's module globals, so with --impl student yours run.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from chapters.ch01_map.checkpoint import Stage, rel_err, timed
from chapters.ch03_prefill.checkpoint import print_table
from chapters.ch08_fusion import fusion
from tinyvllm.engine.block_manager import BlockManager, plan_decode, plan_prefill
from tinyvllm.formats.checkpoints import PRESETS, resolve_model
from tinyvllm.formats.tokenizer import load_tokenizer
from tinyvllm.model.backend import numpy_ops
from tinyvllm.model.decode import decode_batch
from tinyvllm.model.kv_pool import PagedKVPool
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill_batch

ROOT = Path(__file__).resolve().parent.parent.parent
H200_RUN = ROOT / "bench" / "results" / "decode-20261130-004843.json"
PROMPT = "What is the capital of France?"
NEW_TOKENS = 8
ROWS = 3              # (c): three sequences' rows, as a decode step of batch 3 has
NUM_BLOCKS = 8        # 128 slots: the prompt and its answer
MAX_TOKENS = 64
TOLERANCE = 1e-5      # float32 relative error: the same arithmetic as the engine's, summed in other orders


def check_bytes() -> list[Stage]:
    """(a) the byte count and the floor, against what the H200 run recorded."""
    run = json.loads(H200_RUN.read_text())
    llama = PRESETS["llama-3.2-1b"]
    nbytes = fusion.step_bytes(llama, run["batch"], run["context"])
    floor = fusion.floor_ms(nbytes, run["copy_bandwidth_gb_s"])
    smol = PRESETS["smollm2-135m"]
    return [Stage(f"(a) step_bytes, Llama 3.2 1B, batch {run['batch']}, context {run['context']}", f"{nbytes:,} B",
                  0.0, f"the H200 run read {run['bytes_per_step']:,} B", int(nbytes) == run["bytes_per_step"]),
            Stage(f"(a) floor_ms at {run['copy_bandwidth_gb_s']:,.0f} GB/s", f"{floor:.3f} ms", 0.0,
                  f"the run's floor {run['floor_ms']:.3f} ms; it measured {run['kernel_ms']:.3f} ms of kernels, "
                  f"{run['ms_per_token']:.3f} ms per token", abs(floor - run["floor_ms"]) < 1e-9),
            Stage("(a) step_bytes, SmolLM2-135M, batch 1, context 512", f"{fusion.step_bytes(smol, 1, 512):,} B", 0.0)]


def print_kernels() -> None:
    """(b) a layer's kernels before and after fusion, and a step's launches."""
    llama = PRESETS["llama-3.2-1b"]
    for fused in (False, True):
        kernels = fusion.layer_kernels(llama, 1, 512, fused)
        step = fusion.step_kernels(llama, 1, 512, fused)
        print(f"(b) one layer of Llama 3.2 1B at batch 1, {'after' if fused else 'before'} fusion: {len(kernels)} "
              f"launches, {sum(k.activations for k in kernels) / 1e3:.1f} KB of activations "
              f"({len(step)} launches per step)")
        for k in kernels:
            print(f"    {k.name:<21} {k.what:<16} {k.moved / 1e6:9.3f} MB  {k.blocks:5d} blocks  {k.io}")
    print()


def unfused_and_fused(name: str, unfused, fused, seconds_of: str) -> Stage:
    """Run the engine's sequence and the fused op on copies of the same inputs; compare their outputs."""
    expected, got = unfused(), fused()
    err = rel_err(got, expected)
    return Stage(name, seconds_of, 0.0, f"rel err {err:.1e} vs the engine's unfused ops", bool(err < TOLERANCE))


def check_fused_ops(model: Model, rng: np.random.Generator) -> list[Stage]:
    """(c) layer 0's fused ops on rows of the real embedding (layer 0's input) against numpy_ops."""
    layer, cfg, eps = model.layers[0], model.cfg, model.cfg.rms_norm_eps
    ids = rng.integers(0, cfg.vocab_size, ROWS)
    residual = model.embed[ids].astype(np.float32)
    qkv_cols, inter = layer.qkv.shape[0], cfg.intermediate_size
    blocks = fusion.num_blocks

    def norm_then(norm_weight: np.ndarray, w: np.ndarray) -> np.ndarray:   # add_rms_norm (no delta), then the GEMM
        normed = np.empty_like(residual)
        numpy_ops.add_rms_norm(residual.copy(), None, norm_weight, normed, eps)
        out = np.empty((ROWS, w.shape[0]), np.float32)
        numpy_ops.gemm(normed, w, out)
        return out

    def unfused_swiglu() -> np.ndarray:
        act = np.empty((ROWS, inter), np.float32)
        numpy_ops.swiglu(norm_then(layer.post_norm, layer.gate_up), act)
        return act

    def fused_qkv() -> np.ndarray:
        out = np.full((ROWS, qkv_cols), np.nan, np.float32)
        fusion.rms_norm_gemv(residual, layer.input_norm, layer.qkv, out, eps)
        return out

    def fused_swiglu() -> np.ndarray:
        act = np.full((ROWS, inter), np.nan, np.float32)
        fusion.rms_norm_gemv_swiglu(residual, layer.post_norm, layer.gate_up, act, eps)
        return act

    attn = rng.standard_normal((ROWS, cfg.q_size)).astype(np.float32)

    def unfused_add() -> np.ndarray:                # gemm into delta, then add_rms_norm's add
        delta = np.empty_like(residual)
        numpy_ops.gemm(attn, layer.o_proj, delta)
        return residual + delta

    def fused_add() -> np.ndarray:
        after = residual.copy()
        fusion.gemv_add(attn, layer.o_proj, after)
        return after

    cols = fusion.COLS_PER_BLOCK
    return [unfused_and_fused("(c) rms_norm_gemv: norm + qkv", lambda: norm_then(layer.input_norm, layer.qkv), fused_qkv,
                              f"{blocks(qkv_cols, cols)} blocks x {cols} columns"),
            unfused_and_fused("(c) rms_norm_gemv_swiglu: norm + gate_up + swiglu", unfused_swiglu, fused_swiglu,
                              f"{blocks(inter, cols)} blocks x {cols} columns"),
            unfused_and_fused("(c) gemv_add: o_proj + the residual add", unfused_add, fused_add, f"({ROWS}, "
                              f"{cfg.hidden_size}) residual")]


def greedy(model: Model, decode, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """NEW_TOKENS greedy tokens: the engine's prefill, then decode(pool, plan) steps; the tokens and the
    logits of every decode step."""
    blocks, pool = BlockManager(NUM_BLOCKS), PagedKVPool(model.cfg, model.ops, NUM_BLOCKS)
    tokens = [int(prefill_batch(model, pool, [plan_prefill(blocks, 0, prompt)])[0].argmax())]
    logits = []
    while len(tokens) < NEW_TOKENS:
        logits.append(decode(pool, plan_decode(blocks, [0], tokens[-1:]))[0].copy())
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def main() -> bool:
    model_dir = resolve_model("default")
    tok = load_tokenizer(model_dir)
    model, build_s = timed(Model, model_dir, "cpu", MAX_TOKENS)
    cfg = model.cfg
    which = "yours" if fusion.rms_norm_gemv_block.__module__.startswith("chapters.ch08_fusion.exercises") \
        else "the chapter's"
    print(f"model: {model_dir} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, intermediate "
          f"{cfg.intermediate_size}) on the CPU (NumPy)\nstep_bytes, floor_ms and the thread blocks: {which}; "
          f"the H200 numbers: {H200_RUN.relative_to(ROOT)}\n")
    stages = [Stage("engine Model on cpu", f"{sum(w.nbytes for w in model.weights.values()) / 1e6:.0f} MB of f32 "
                    "weights", build_s), *check_bytes()]
    print_kernels()
    stages += check_fused_ops(model, np.random.default_rng(8))

    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    (expected, expected_logits), seconds = timed(greedy, model, lambda pool, plan: decode_batch(model, pool, plan),
                                                 prompt)
    stages.append(Stage(f"decode_batch: prefill + {NEW_TOKENS - 1} decode steps", f"{NEW_TOKENS} tokens", seconds))
    (tokens, logits), seconds = timed(greedy, model, lambda pool, plan: fusion.decode_fused(model, pool, plan), prompt)
    err, same = max(rel_err(a, b) for a, b in zip(logits, expected_logits)), tokens == expected
    stages.append(Stage("(d) decode_fused: the same, 7 kernels a layer", f"{NEW_TOKENS} tokens", seconds,
                        f"max rel err {err:.1e} over {len(logits)} steps; greedy tokens "
                        f"{'identical' if same else 'differ'}", bool(err < TOLERANCE and same)))
    print(f"prompt: {PROMPT!r} ({len(prompt)} tokens with the chat template)\n"
          f"  decode_batch  -> {tok.decode(expected)!r}\n  decode_fused  -> {tok.decode(tokens)!r}\n")
    print_table(stages)
    ok = all(s.ok is not False for s in stages)
    print("checkpoint 8:", "PASSED" if ok else "FAILED")
    return ok
