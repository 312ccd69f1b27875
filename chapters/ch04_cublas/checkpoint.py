"""`make chapter-4`: every GEMM of a layer of the default model, as cuBLAS sees it, checked against NumPy.

For layer 0's four GEMMs (fused QKV, o_proj, fused gate/up, down) and the lm_head, the parameters of the
transposition trick (`gemm_params`) drive the column-major emulator on the real weights and a random
activation; the result must be NumPy's x @ W.T. Then: the naive call leaves Y^T's bytes; Q, K and V
written by three GEMMs into column slices of one buffer (`gemm_params_into_slice`) equal the fused
GEMM; and, on a GPU, the same GEMMs through cuBLAS in bf16.

The parameters are looked up through their module at call time, so `make chapter-4 IMPL=student`
runs every check on the learner's functions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tinyvllm.formats.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from tinyvllm.formats.checkpoints import resolve_model
from tinyvllm.formats.config import LlamaConfig
from tinyvllm.model import gemm
from tinyvllm.model.backend import cuda_available
from tinyvllm.model.gemm import OP_N, OP_T, gemm_colmajor
from tinyvllm.model.model import Model, plan_engine_weights

T = 17                   # tokens in the random activation: odd, and neither 1 (decode) nor a power of two
FP32_TOLERANCE = 1e-5    # emulator vs NumPy: both float32, only the summation order differs
BF16_TOLERANCE = 1e-2    # cuBLAS bf16 in (and out) vs the float32 product of the same bf16 values
NAN_BF16 = np.uint16(0x7FC0)
# where each GEMM reads X from and writes Y to, in the buffers of chapter 2
BUFFERS = {"qkv": ("normed", "qkv"), "o_proj": ("attn_out", "delta"), "gate_up": ("normed", "gate_up"),
           "down": ("mlp_act", "delta"), "lm_head": ("normed", "logits")}


@dataclass
class Gemm:
    """Y (T, N) = X (T, K) @ W (N, K)^T, with W one of the engine's (fused) weights."""
    name: str
    N: int
    K: int

    @property
    def flops_per_token(self) -> int:
        return 2 * self.N * self.K  # one multiply and one add per weight


def layer_gemms(cfg: LlamaConfig) -> list[Gemm]:
    """The GEMMs of one layer, in execution order, with the engine's fused weights, then the lm_head."""
    layer0 = [r for r in plan_engine_weights(cfg, "f32") if r.name.startswith("0.") and len(r.shape) == 2]
    return [Gemm(r.name[2:], *r.shape) for r in layer0] + [Gemm("lm_head", cfg.vocab_size, cfg.hidden_size)]


def flag(op: int) -> str:
    return {OP_N: "N", OP_T: "T"}.get(op, f"?{op}")


def print_gemm_table(cfg: LlamaConfig, model_name: str) -> None:
    print(f"the GEMMs of one layer of {model_name} (T = {T} tokens), as cublasGemmEx is called:\n")
    print(f"  {'gemm':<8} {'X -> Y (buffers)':<22} {'Y (T,N) = X (T,K) W(N,K)^T':<36} transa transb"
          f"{'m':>7}{'n':>5}{'k':>6}{'lda':>6}{'ldb':>6}{'ldc':>7}  MFLOP/token")
    for g in layer_gemms(cfg):
        p = gemm.gemm_params(T, g.N, g.K)
        shapes = f"({T},{g.N}) = ({T},{g.K}) ({g.N},{g.K})^T"
        print(f"  {g.name:<8} {' -> '.join(BUFFERS[g.name]):<22} {shapes:<36} {flag(p['transa']):>6} "
              f"{flag(p['transb']):>6}{p['m']:>7}{p['n']:>5}{p['k']:>6}{p['lda']:>6}{p['ldb']:>6}{p['ldc']:>7}"
              f"  {g.flops_per_token / 1e6:11.2f}")
    total = sum(g.flops_per_token for g in layer_gemms(cfg)[:-1])
    print(f"\n  per layer {total / 1e6:.2f} MFLOP/token; x {cfg.num_hidden_layers} layers + lm_head = "
          f"{(total * cfg.num_hidden_layers + layer_gemms(cfg)[-1].flops_per_token) / 1e9:.3f} GFLOP/token\n")


# ---- the verdict table ----

class Verdicts:
    def __init__(self):
        self.rows: list[tuple[str, str, str, str, str]] = []

    def add(self, what: str, shape: tuple[int, ...], err: float, seconds: float, ok: bool, note: str = "") -> None:
        self.rows.append((what, str(shape), f"{err:.1e}", f"{seconds * 1e3:.1f} ms",
                          ("ok" if ok else "FAIL") + (f" ({note})" if note else "")))

    def skip(self, what: str, why: str) -> None:
        self.rows.append((what, "-", "-", "-", f"skipped: {why}"))

    def fail(self, what: str, why: str) -> None:
        self.rows.append((what, "-", "-", "-", f"FAIL: {why}"))

    @property
    def ok(self) -> bool:
        return all(r[-1].startswith(("ok", "skipped")) for r in self.rows)

    def show(self) -> None:
        header = ("check", "Y", "rel err", "time", "result")
        widths = [max(len(r[i]) for r in [header, *self.rows]) for i in range(4)]
        for row in [header, *self.rows]:
            print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                                   enumerate(zip(row, widths))) + "  " + row[4])


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def emulate(p: dict, x: np.ndarray, w: np.ndarray, C: np.ndarray) -> None:
    """cublasGemmEx(transa, transb, m, n, k, 1, A=W, lda, B=X, ldb, 0, C, ldc) on flat float32 buffers."""
    gemm_colmajor(p["transa"], p["transb"], p["m"], p["n"], p["k"], 1.0, w.reshape(-1), p["lda"],
                  x.reshape(-1), p["ldb"], 0.0, C, p["ldc"])


# ---- the checks ----

def check_emulator(g: Gemm, w: np.ndarray, x: np.ndarray, v: Verdicts) -> None:
    """The trick's parameters on the emulator, C full of NaN: every element must be written, and right."""
    C = np.full(T * g.N, np.nan, np.float32)
    start = time.perf_counter()
    try:
        emulate(gemm.gemm_params(T, g.N, g.K), x, w, C)
    except AssertionError as e:  # the emulator rejects sizes and leading dimensions that do not fit the buffers
        return v.fail(f"emulator: {g.name}", str(e))
    seconds = time.perf_counter() - start
    y = C.reshape(T, g.N)  # the flat buffer read row-major: no transpose, no copy
    err = rel_err(y, x @ w.T) if not np.isnan(y).any() else float("nan")
    v.add(f"emulator: {g.name}", y.shape, err, seconds, err < FP32_TOLERANCE)


def check_naive_call(g: Gemm, w: np.ndarray, x: np.ndarray, v: Verdicts) -> None:
    """Asking for Y itself (A = X, B = W, m = T, n = N) writes Y column-major: the buffer holds Y^T's bytes."""
    C = np.full(T * g.N, np.nan, np.float32)
    start = time.perf_counter()
    gemm_colmajor(OP_T, OP_N, T, g.N, g.K, 1.0, x.reshape(-1), g.K, w.reshape(-1), g.K, 0.0, C, T)
    seconds = time.perf_counter() - start
    y = x @ w.T
    err = rel_err(C.reshape(g.N, T), y.T)
    wrong = rel_err(C.reshape(T, g.N), y)  # what a row-major reader would take for Y
    v.add(f"naive call on {g.name}: buffer = Y^T", (g.N, T), err, seconds, err < FP32_TOLERANCE and wrong > 0.5,
          f"read as Y: rel err {wrong:.2f}")


def check_slices(cfg: LlamaConfig, w_qkv: np.ndarray, x: np.ndarray, v: Verdicts) -> None:
    """Q, K and V by three GEMMs into column slices of one (T, q + 2 kv) buffer == the fused GEMM."""
    q, kv = cfg.q_size, cfg.kv_size
    qkv = np.full((T, q + 2 * kv), np.nan, np.float32)
    start = time.perf_counter()
    try:
        for first, n in ((0, q), (q, kv), (q + kv, kv)):  # the fused weight's rows: q_proj, k_proj, v_proj
            p = gemm.gemm_params_into_slice(T, n, cfg.hidden_size, row_stride=qkv.shape[1])
            emulate(p, x, w_qkv[first:first + n], qkv.reshape(-1)[first:])  # C points at row 0, column `first`
    except AssertionError as e:
        return v.fail("Q, K, V into column slices (ldc > N)", str(e))
    seconds = time.perf_counter() - start
    err = rel_err(qkv, x @ w_qkv.T) if not np.isnan(qkv).any() else float("nan")
    v.add("Q, K, V into column slices (ldc > N)", qkv.shape, err, seconds, err < FP32_TOLERANCE,
          f"ldc = {qkv.shape[1]}")


def check_cublas(gemms: list[Gemm], weights: dict[str, np.ndarray], rng: np.random.Generator, v: Verdicts) -> None:
    """The same GEMMs through cuBLAS: bf16 weights and activations, fp32 accumulation, bf16 (logits fp32) out."""
    import cupy as cp

    from tinyvllm.model.gemm import gemm_cublas

    for g in gemms:
        w, logits = weights[g.name], g.name == "lm_head"
        x16 = bf16_values(rng.standard_normal((T, g.K), dtype=np.float32))
        out = cp.full((T, g.N), np.nan, cp.float32) if logits else cp.full((T, g.N), NAN_BF16, cp.uint16)
        gx, gw = cp.asarray(float32_to_bf16_bits(x16)), cp.asarray(float32_to_bf16_bits(w))  # w: exact, it was bf16
        y, seconds = timed_on_gpu(lambda: gemm_cublas(gx, gw, out), out)
        err = rel_err(y, x16 @ w.T) if not np.isnan(y).any() else float("nan")
        v.add(f"cuBLAS bf16: {g.name}" + (" (fp32 out)" if logits else ""), y.shape, err, seconds,
              err < BF16_TOLERANCE)


def check_cublas_slices(cfg: LlamaConfig, w_qkv: np.ndarray, rng: np.random.Generator, v: Verdicts) -> None:
    """Q, K and V by three cuBLAS calls into column slices of one bf16 buffer (ldc = the buffer's row width)."""
    import cupy as cp

    from tinyvllm.model.gemm import gemm_cublas

    q, kv = cfg.q_size, cfg.kv_size
    x16 = bf16_values(rng.standard_normal((T, cfg.hidden_size), dtype=np.float32))
    gx, qkv = cp.asarray(float32_to_bf16_bits(x16)), cp.full((T, q + 2 * kv), NAN_BF16, cp.uint16)
    parts = [(first, cp.asarray(float32_to_bf16_bits(w_qkv[first:first + n])))
             for first, n in ((0, q), (q, kv), (q + kv, kv))]

    def three_gemms():
        for first, gw in parts:
            gemm_cublas(gx, gw, qkv[:, first:first + gw.shape[0]])  # a view: its row stride becomes ldc
    y, seconds = timed_on_gpu(three_gemms, qkv)
    err = rel_err(y, x16 @ w_qkv.T) if not np.isnan(y).any() else float("nan")
    v.add("cuBLAS bf16: Q, K, V into column slices", y.shape, err, seconds, err < BF16_TOLERANCE,
          f"ldc = {qkv.shape[1]}")


def bf16_values(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bf16, as float32: the exact values the GPU will multiply."""
    return bf16_bits_to_float32(float32_to_bf16_bits(x))


def timed_on_gpu(fn, out) -> tuple[np.ndarray, float]:
    """Run fn twice (the first call pays cuBLAS's one-off set-up), time the second; out as float32 on the host."""
    import cupy as cp
    stream = cp.cuda.get_current_stream()
    fn()
    stream.synchronize()
    start = time.perf_counter()
    fn()
    stream.synchronize()
    seconds = time.perf_counter() - start
    host = cp.asnumpy(out)
    return (bf16_bits_to_float32(host) if host.dtype == np.uint16 else host), seconds


def main() -> bool:
    model_dir = resolve_model("default")
    start = time.perf_counter()
    model = Model(model_dir, device="cpu", max_num_batched_tokens=T)  # float32 fused weights, as the CPU engine runs
    cfg, layer = model.cfg, model.layers[0]
    print(f"model: {model_dir} (loaded in {time.perf_counter() - start:.1f} s)\n")
    print_gemm_table(cfg, model_dir.name)

    weights = {"qkv": layer.qkv, "o_proj": layer.o_proj, "gate_up": layer.gate_up, "down": layer.down,
               "lm_head": model.lm_head}
    gemms = layer_gemms(cfg)
    rng = np.random.default_rng()
    v = Verdicts()
    for g in gemms:
        x = rng.standard_normal((T, g.K), dtype=np.float32)
        check_emulator(g, weights[g.name], x, v)
    x = rng.standard_normal((T, cfg.hidden_size), dtype=np.float32)
    check_naive_call(gemms[0], weights["qkv"], x, v)
    check_slices(cfg, weights["qkv"], x, v)
    if not cuda_available():
        v.skip("cuBLAS bf16: every GEMM above", "no CUDA device (needs CuPy and an NVIDIA GPU)")
    elif not v.ok:  # parameters that fail on the emulator could make cuBLAS write outside a buffer
        v.skip("cuBLAS bf16: every GEMM above", "the emulator checks must pass first")
    else:
        check_cublas(gemms, weights, rng, v)
        check_cublas_slices(cfg, weights["qkv"], rng, v)
    v.show()
    print(f"\nchapter 4: {'PASS' if v.ok else 'FAIL'}")
    return v.ok
