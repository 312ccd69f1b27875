"""Chapter 5: where a step's time goes — every backend op timed, on the device that runs it.

    with timed_ops(model) as timer:
        decode_step(model, [token], cache, [0])
    timer.totals()   # {"gemm": seconds, "decode_attention": seconds, ...}

On the GPU each op is bracketed by two CUDA events. Call hold_gpu() first: the GPU then waits while
the host queues the whole step behind it, and runs the kernels back to back, so each pair of events
times a kernel alone. The step's wall time minus the kernels' sum is what launching them one by one
cost (the "launch gaps" that CUDA graphs remove in chapter 7). On the CPU each op is timed with
perf_counter.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from types import ModuleType

# Backend attributes that are not ops: data movement and constants
NOT_OPS = {"blob", "to_device", "to_host", "upload_weight", "xp", "DTYPE"}


class OpTimer:
    """Stands in for a backend module: same attributes, each op call recorded as (name, seconds)."""

    def __init__(self, ops: ModuleType):
        self._ops, self.calls = ops, []
        self._gpu = ops.xp.__name__ == "cupy"

    def __getattr__(self, name: str):
        attr = getattr(self._ops, name)
        if name in NOT_OPS or name.startswith("_") or not callable(attr):
            return attr
        return lambda *args, **kwargs: self._timed(name, attr, args, kwargs)

    def _timed(self, name: str, fn, args, kwargs):
        if self._gpu:
            start, end = self._ops.xp.cuda.Event(), self._ops.xp.cuda.Event()
            start.record()
            result = fn(*args, **kwargs)
            end.record()
            self.calls.append((name, (start, end)))
        else:
            t = time.perf_counter()
            result = fn(*args, **kwargs)
            self.calls.append((name, time.perf_counter() - t))
        return result

    def seconds(self) -> list[tuple[str, float]]:
        """Every call in order, with its time (waits for the GPU to finish)."""
        if self._gpu:
            cp = self._ops.xp
            cp.cuda.get_current_stream().synchronize()
            return [(n, cp.cuda.get_elapsed_time(s, e) / 1e3) for n, (s, e) in self.calls]
        return list(self.calls)

    def totals(self) -> dict[str, float]:
        """Seconds per op name, summed over its calls, largest first."""
        sums: dict[str, float] = defaultdict(float)
        for name, s in self.seconds():
            sums[name] += s
        return dict(sorted(sums.items(), key=lambda kv: -kv[1]))


@contextmanager
def timed_ops(model):
    """Time every op `model` runs inside the block; the model's own backend is put back afterwards."""
    timer, original = OpTimer(model.ops), model.ops
    model.ops = timer
    try:
        yield timer
    finally:
        model.ops = original


# A GPU "sleep": spins on the nanosecond global timer. Not an engine kernel, a measuring tool.
_SPIN = r"""
extern "C" __global__ void spin(long long ns) {
    long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}"""


def hold_gpu(seconds: float = 0.05) -> None:
    """Keep the GPU busy for `seconds`, so the work queued next starts only once the host has queued it all."""
    import cupy as cp
    cp.RawKernel(_SPIN, "spin")((1,), (1,), (cp.int64(seconds * 1e9),))
