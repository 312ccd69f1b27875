"""`make chapter-2`: read the default model's checkpoint from scratch, check it, build the one blob.

Every step calls the engine through its modules (safetensors_format.parse_header, bf16.*, buffers.lay_out),
so `make chapter-2 IMPL=student` runs the same steps on the learner's exercise functions.
"""
from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np

from tinyvllm.formats import bf16, safetensors_format
from tinyvllm.formats.checkpoints import resolve_model
from tinyvllm.formats.config import load_config
from tinyvllm.model import buffers, weights
from tinyvllm.model.memory_map import bytes_by_kind

MAX_TOKENS = 512  # the largest step the buffer plan is sized for (as `python -m tinyvllm info`)


class Verdicts:
    """Rows of the verdict table: what ran, how many, how many bytes, how long, the result."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str, str]] = []

    def add(self, what: str, count: int, nbytes: int, seconds: float, result: str) -> None:
        self.rows.append((what, f"{count:,}", f"{nbytes:,}", f"{seconds:.2f} s", result))

    def skip(self, what: str, why: str) -> None:
        self.rows.append((what, "-", "-", "-", f"skipped: {why}"))

    @property
    def ok(self) -> bool:
        return all(r[-1] == "ok" or r[-1].startswith("skipped") for r in self.rows)

    def show(self) -> None:
        header = ("check", "count", "bytes", "time", "result")
        widths = [max(len(r[i]) for r in [header, *self.rows]) for i in range(4)]
        for row in [header, *self.rows]:
            print("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                                   enumerate(zip(row, widths))) + "  " + row[4])


def show_header(path: Path) -> None:
    """The first bytes of the file, as the format describes them."""
    with open(path, "rb") as f:
        length_bytes = f.read(8)
        start = f.read(160)
    n = struct.unpack("<Q", length_bytes)[0]
    print(f"file   {path}  ({path.stat().st_size:,} bytes)")
    print(f"bytes 0-7    {length_bytes.hex(' ')}  = header length {n:,} (little-endian u64)")
    print(f"bytes 8-...  {start.decode(errors='replace')}...")
    print(f"data section starts at byte {8 + n:,}\n")


def check_against_library(f: safetensors_format.SafetensorsFile, v: Verdicts) -> None:
    """Every tensor's bytes as our reader sees them == as the safetensors library sees them."""
    try:
        import torch
        from safetensors import safe_open
    except ImportError as e:
        v.skip("bytes vs the safetensors library", f"{e.name} is not installed (make test installs it)")
        return
    t0, same, nbytes = time.perf_counter(), 0, 0
    with safe_open(str(f.path), framework="pt") as lib:
        names_match = set(lib.keys()) == set(f.tensors)
        for name in lib.keys():
            ref = lib.get_tensor(name)
            ref_bits = ref.view(torch.int16) if ref.dtype == torch.bfloat16 else ref  # numpy has no bf16
            ours = f.get(name)
            same += ours.shape == tuple(ref.shape) and ours.tobytes() == ref_bits.numpy().tobytes()
            nbytes += ours.nbytes
    ok = names_match and same == len(f.tensors)
    v.add("bytes vs the safetensors library", same, nbytes, time.perf_counter() - t0,
          "ok" if ok else f"FAIL: {len(f.tensors) - same} tensors differ")


def check_widening(f: safetensors_format.SafetensorsFile, v: Verdicts) -> None:
    """bf16 -> float32 of every weight == torch's bfloat16 -> float32 of the library's tensor, bit for bit."""
    try:
        import torch
        from safetensors import safe_open
    except ImportError as e:
        v.skip("bf16 -> f32 vs torch", f"{e.name} is not installed (make test installs it)")
        return
    t0, values, wrong = time.perf_counter(), 0, 0
    with safe_open(str(f.path), framework="pt") as lib:
        for name in f.tensors:
            ours = bf16.bf16_bits_to_float32(f.get(name))
            ref = lib.get_tensor(name).to(torch.float32).numpy()
            wrong += int(np.count_nonzero(ours.view(np.uint32) != ref.view(np.uint32)))
            values += ours.size
    v.add("bf16 -> f32 vs torch (values)", values, 4 * values, time.perf_counter() - t0,
          "ok" if wrong == 0 else f"FAIL: {wrong:,} values differ")


def check_narrowing(f: safetensors_format.SafetensorsFile, v: Verdicts) -> None:
    """f32 -> bf16: the model's weights come back bit-exact, random values round like torch."""
    t0, values, wrong = time.perf_counter(), 0, 0
    for name in f.tensors:  # every bf16 is exactly a float32, so the round trip must be exact
        bits = f.get(name)
        wrong += int(np.count_nonzero(bf16.float32_to_bf16_bits(bf16.bf16_bits_to_float32(bits)) != bits))
        values += bits.size
    v.add("f32 -> bf16 round trip of the weights", values, 2 * values, time.perf_counter() - t0,
          "ok" if wrong == 0 else f"FAIL: {wrong:,} values changed")
    try:
        import torch
    except ImportError:
        v.skip("f32 -> bf16 rounding vs torch", "torch is not installed (make test installs it)")
        return
    t0 = time.perf_counter()
    u = np.random.default_rng().integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    u[::4] = (u[::4] & 0xFFFF0000) | 0x8000  # a quarter are exact ties: they must go to the even neighbour
    x = u.view(np.float32)
    ours, finite = bf16.float32_to_bf16_bits(x), ~np.isnan(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    wrong = int(np.count_nonzero(ours[finite] != ref[finite]))
    wrong += int(np.count_nonzero(~np.isnan(bf16.bf16_bits_to_float32(ours[~finite]))))  # NaN stays NaN
    v.add("f32 -> bf16 rounding vs torch (random bits)", x.size, 4 * x.size, time.perf_counter() - t0,
          "ok" if wrong == 0 else f"FAIL: {wrong:,} values rounded differently")


def check_blob(model_dir: Path, f: safetensors_format.SafetensorsFile, v: Verdicts) -> None:
    """One allocation; every weight a view inside it, aligned, holding the widened file values."""
    t0 = time.perf_counter()
    w = weights.load_weights(model_dir, load_config(model_dir))
    seconds = time.perf_counter() - t0
    start, problems = w.blob.ctypes.data, []
    for name, view in w.views.items():
        address = view.ctypes.data
        if not (np.shares_memory(view, w.blob) and start <= address <= start + w.blob.nbytes - view.nbytes):
            problems.append(f"{name} is not inside the blob")
        elif address % buffers.ALIGN:
            problems.append(f"{name} starts {address % buffers.ALIGN} bytes past an aligned address")
        elif not np.array_equal(view, bf16.bf16_bits_to_float32(f.get(name))):
            problems.append(f"{name} holds other values than the file")
    v.add("one blob, every weight a view in it", len(w.views), w.blob.nbytes, seconds,
          "ok" if not problems else f"FAIL: {problems[0]}")


def print_plan(model_dir: Path) -> None:
    """A compact `python -m tinyvllm info`: the two blobs a CPU run allocates."""
    cfg = load_config(model_dir)
    plan_w = weights.plan_weights(cfg, "f32")
    plan_b = buffers.plan_buffers(cfg, MAX_TOKENS, "f32")
    mib = 2**20
    kinds = ", ".join(f"{k} {n / mib:.1f}" for k, n in bytes_by_kind(plan_w).items())
    print("\nmemory plan (CPU, f32; python -m tinyvllm info for the full table)")
    print(f"  weights  {buffers.blob_size(plan_w) / mib:7.1f} MiB in {len(plan_w)} views  ({kinds} MiB)")
    print(f"  buffers  {buffers.blob_size(plan_b) / mib:7.1f} MiB for a step of {MAX_TOKENS} tokens, "
          "reused by every step:")
    for r in plan_b:
        print(f"    {r.name:<9} {str(list(r.shape)):<14} {r.nbytes / mib:6.2f} MiB at offset {r.offset:,}")


def main() -> bool:
    model_dir = resolve_model("default")
    path = model_dir / "model.safetensors"
    show_header(path)
    v = Verdicts()
    t0 = time.perf_counter()
    f = safetensors_format.SafetensorsFile(path)  # read_header -> parse_header, through the module
    v.add("parse and validate the header", len(f.tensors), sum(t.nbytes for t in f.tensors.values()),
          time.perf_counter() - t0, "ok" if f.tensors else "FAIL: no tensors")
    check_against_library(f, v)
    check_widening(f, v)
    check_narrowing(f, v)
    check_blob(model_dir, f, v)
    v.show()
    print_plan(model_dir)
    print(f"\nchapter 2: {'PASS' if v.ok else 'FAIL'}")
    return v.ok
