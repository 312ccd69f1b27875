"""`make chapter-3`: the chat prompt through every layer of the engine's prefill, checked layer by layer.

    make chapter-3                  # python -m chapters 3: on the GPU if CuPy sees one, else on the CPU
    make chapter-3 IMPL=student     # the same, with your online_softmax_attention (Exercise 3.1)

prefill() runs with its on_layer hook, so the residual stream can be read back after every layer;
its logits, K/V and time are checked too.
The reference is chapter 1's NumPy model. Engine functions are called through their modules
(`reference.online_softmax_attention`), so the student's function, plugged in by --impl student, runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from chapters.ch01_map import checkpoint as ch01
from chapters.ch01_map.checkpoint import Stage, rel_err, timed
from tinyvllm import reference
from tinyvllm.formats import bf16
from tinyvllm.formats.config import LlamaConfig
from tinyvllm.model.backend import cuda_available
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill

PROMPT = "What is 2+2?"
MESSAGES = [{"role": "user", "content": PROMPT}]
TOLERANCE = {"cpu": 1e-5, "cuda": 2e-2}  # relative error vs the float32 reference: f32 twins / bf16 kernels
EXERCISE_TOLERANCE = 1e-5                # Exercise 3.1 runs in NumPy float32 on either device
BLOCK = 16                               # Exercise 3.1's key tile: 37 tokens -> tiles of 16, 16 and 5
MAX_TOKENS = 256                         # the engine's buffers are planned for prompts up to this length


def gemm_intensity(cfg: LlamaConfig, tokens: int) -> float:
    """FLOPs per byte moved by one layer's four GEMMs (fused QKV, o_proj, fused gate/up, down), all bf16.

    Each (T, K) x (K, N) GEMM does 2 T K N FLOPs and moves its weights, input and output once.
    """
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = [(h, cfg.q_size + 2 * cfg.kv_size), (cfg.q_size, h), (h, 2 * inter), (inter, h)]  # (K, N)
    flops = sum(2 * tokens * k * n for k, n in shapes)
    nbytes = sum(2 * (k * n + tokens * k + tokens * n) for k, n in shapes)
    return flops / nbytes


# ---- the reference: chapter 1's NumPy model, one layer at a time ----

@dataclass
class ReferenceRun:
    stream: list[np.ndarray] = field(default_factory=list)  # the residual stream: embedding, then after each layer
    qkv: list[tuple] = field(default_factory=list)          # each layer's q (T, H, d), k and v (T, KVH, d), RoPE'd
    logits: np.ndarray | None = None                        # the last position's (vocab,)


def reference_layers(model: reference.ReferenceModel, ids: list[int], round_stream=None) -> ReferenceRun:
    """The forward pass with every layer's intermediate results kept; round_stream(x), if given, is
    applied to the residual stream after each addition (to try a lower-precision stream)."""
    keep = round_stream or (lambda x: x)
    cos, sin = reference.rope_cos_sin(model.inv_freq, np.arange(len(ids)))
    x = ch01.embed(model, ids)
    run = ReferenceRun(stream=[x])
    for i in range(model.cfg.num_hidden_layers):
        q, k, v = model.project_qkv(i, x, cos, sin)
        x = keep(x + model.attention_block(i, q, k, v))
        x = keep(x + model.mlp_block(i, x))
        run.qkv.append((q, k, v))
        run.stream.append(x)
    run.logits = model.lm_head_logits(x[-1:])[0]  # only the last position picks the next token
    return run


# ---- the engine: tinyvllm/model/prefill.py's loop, reading the stream back after every layer ----

def host_f32(ops, a) -> np.ndarray:
    """A copy of a device array on the host as float32 (bf16 bits widened): buffers are reused."""
    a = ops.to_host(a)
    return bf16.bf16_bits_to_float32(a) if a.dtype == np.uint16 else np.array(a, dtype=np.float32)


def engine_layers(model: Model, ids: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """Run prefill() and read the residual stream back after every layer through its on_layer hook;
    returns that stream (one (T, hidden) array per layer) and the last position's logits, on the host."""
    stream = []

    def on_layer(residual, delta):  # the MLP's output is added by the next norm: the stream is residual + delta
        stream.append(host_f32(model.ops, residual) + host_f32(model.ops, delta))

    logits, _ = prefill(model, ids, on_layer=on_layer)
    return stream, host_f32(model.ops, logits)


def time_prefill(model: Model, ids: list[int], repeats: int = 5) -> tuple[float, int]:
    """Median seconds of prefill() + the argmax kernel, until the one chosen id is on the host."""
    out, times = model.ops.xp.empty(1, dtype=np.int32), []
    for _ in range(repeats + 1):  # the first run compiles the kernels (GPU) and warms every cache
        start = time.perf_counter()
        logits, _ = prefill(model, ids)
        model.ops.argmax(logits[None], out)  # only the id crosses to the host, never the logits
        token = int(model.ops.to_host(out)[0])
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:])), token


# ---- the checks ----

def check_exercise(ref: ReferenceRun) -> Stage:
    """Exercise 3.1 on every layer's real Q, K, V: tile by tile must equal reference.attention."""
    start, errors = time.perf_counter(), []
    for q, k, v in ref.qkv:
        out = reference.online_softmax_attention(q, k, v, 0, BLOCK)  # through the module: --impl student
        if out.dtype != np.float32 or out.shape != (len(q), q.shape[1] * q.shape[2]):
            return Stage(f"attention in tiles of {BLOCK} (Ex. 3.1)", f"{out.shape} {out.dtype}",
                         time.perf_counter() - start, "expected float32 (T, H * d)", False)
        errors.append(rel_err(out, reference.attention(q, k, v, 0)))
    worst = np.max(errors)  # np.max, not max(): a NaN must win
    ok = bool(worst < EXERCISE_TOLERANCE)
    return Stage(f"attention in tiles of {BLOCK} (Ex. 3.1)", f"{len(ref.qkv)} layers", time.perf_counter() - start,
                 f"max rel err {worst:.1e} vs reference.attention", ok)


def check_rope_tables(model: Model) -> Stage:
    """The tables prefill and decode share equal the reference's cos/sin at every position."""
    n = model.max_model_len
    cos, sin = reference.rope_cos_sin(reference.rope_inv_freq(model.cfg), np.arange(n))
    half = model.cfg.head_dim // 2  # the reference repeats each angle for both halves of a head
    diff = np.max([np.abs(host_f32(model.ops, model.cos) - cos[:, :half]).max(),
                   np.abs(host_f32(model.ops, model.sin) - sin[:, :half]).max()])
    return Stage("RoPE tables, built once", f"cos, sin ({n}, {half})", 0.0,
                 f"max |diff| {diff:.1e} vs reference.rope_cos_sin", bool(diff < 1e-6))


def check_layers(stream: list[np.ndarray], ref: ReferenceRun, tol: float, seconds: float) -> tuple[Stage, list]:
    errors = [rel_err(ours, theirs) for ours, theirs in zip(stream, ref.stream[1:])]
    worst = int(np.argmax(errors))
    ok = all(e < tol for e in errors) and np.isfinite(errors).all()
    return Stage("prefill loop, layer by layer", f"{len(errors)} x {stream[-1].shape}", seconds,
                 f"worst: after {worst + 1} layers, rel err {errors[worst]:.1e}", bool(ok)), errors


def check_kv(kv: list, ref: ReferenceRun, ops, tol: float) -> Stage:
    """The K (after RoPE) and V that prefill() hands to the cache, every layer."""
    worst = np.max([[rel_err(host_f32(ops, k), rk), rel_err(host_f32(ops, v), rv)]
                    for (k, v), (_, rk, rv) in zip(kv, ref.qkv)])
    return Stage("K, V handed to the cache", f"{len(kv)} x 2 x {tuple(kv[0][0].shape)}", 0.0,
                 f"max rel err {worst:.1e}", bool(worst < tol))


def print_table(stages: list[Stage]) -> None:
    header = ("step", "output", "time", "check vs the reference")
    rows = [(s.name, s.output, f"{s.seconds * 1e3:.1f} ms" if s.seconds else "", s.check,
             {True: "ok", False: "FAIL", None: ""}[s.ok]) for s in stages]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]), row[3].ljust(widths[3])]
        print(("  ".join(cells) + ("  " + row[4] if len(row) > 4 else "")).rstrip())


def print_layer_errors(errors: list[float], per_line: int = 6) -> None:
    print("the residual stream after n layers, relative error vs the reference:")
    for first in range(0, len(errors), per_line):
        print("  " + "   ".join(f"n={i + 1:<2d} {e:.1e}" for i, e in
                                enumerate(errors[first:first + per_line], start=first)))


def check_engine(m: ch01.Loaded, ids: list[int], ref: ReferenceRun, device: str) -> tuple[list[Stage], list]:
    """Build the engine's model, run prefill() watching every layer, and check it against the reference."""
    tol = TOLERANCE[device]
    model, build_s = timed(Model, m.model_dir, device, MAX_TOKENS)
    weight_mb = sum(r.nbytes for r in model.weight_regions) / 1e6
    stages = [Stage(f"engine Model on {device}", f"{weight_mb:.0f} MB of {'bf16' if device == 'cuda' else 'f32'} "
                    "weights", build_s), check_rope_tables(model)]
    (stream, logits), loop_s = timed(engine_layers, model, ids)
    layer_stage, errors = check_layers(stream, ref, tol, loop_s)
    _, kv = prefill(model, ids)
    err = rel_err(logits, ref.logits)
    seconds, token = time_prefill(model, ids)
    expected = int(np.argmax(ref.logits))
    stages += [layer_stage, check_kv(kv, ref, model.ops, tol),
               Stage("last position's logits", f"{logits.shape} f32", 0.0, f"rel err {err:.1e}", bool(err < tol)),
               Stage(f"prefill + argmax on {device}", f"next token {m.tok.decode([token])!r} ({token})", seconds,
                     f"reference's argmax: {m.tok.decode([expected])!r} ({expected})", token == expected)]
    return stages, errors


def main() -> bool:
    device = "cuda" if cuda_available() else "cpu"
    m, load_s = timed(ch01.load)  # tokenizer + the float32 reference model
    cfg = m.cfg
    ids, tok_s = timed(m.tok.apply_chat_template, MESSAGES)
    T = len(ids)
    print(f"model: {m.model_dir}\nprompt: {PROMPT!r} with the chat template -> {T} tokens\n"
          f"device: {device}; tolerance vs the float32 reference: {TOLERANCE[device]:g} relative\n"
          f"one layer's GEMMs at T={T}: {gemm_intensity(cfg, T):.0f} FLOP/byte "
          f"(a one-token decode step: {gemm_intensity(cfg, 1):.1f})\n")

    ref, ref_s = timed(reference_layers, m.model, ids)
    stages = [Stage("tokenize (chat template)", f"{T} ids", tok_s),
              Stage("reference, layer by layer", f"{cfg.num_hidden_layers} x {ref.stream[-1].shape}", ref_s),
              check_exercise(ref)]  # before the engine: a student's unwritten exercise stops the run early
    engine_stages, errors = check_engine(m, ids, ref, device)
    stages += engine_stages

    print(f"reference: chapter 1's NumPy float32 model (loaded in {load_s:.1f} s)\n")
    print_table(stages)
    print()
    print_layer_errors(errors)
    seconds = stages[-1].seconds
    print(f"\nprefill of {T} tokens on {device}: {seconds * 1e3:.1f} ms, {T / seconds:,.0f} tokens/s (median of 5)")
    ok = all(s.ok is not False for s in stages)
    print("checkpoint 3:", "PASSED" if ok else "FAILED")
    return ok
