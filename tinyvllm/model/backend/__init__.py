"""The two backends behind one set of operations: `numpy_ops` (CPU, float32) and `cuda_ops` (CuPy).

Both modules define the same functions with the same signatures and buffer layouts, so the engine's
prefill (and later decode) code is written once and runs on either: every CUDA kernel has its NumPy
twin. `xp` is the array module (numpy or cupy) and `DTYPE` the storage dtype of activations.
"""
from __future__ import annotations

from types import ModuleType

from tinyvllm.errors import TinyVLLMError


def cuda_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no CUDA here"
        return False


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" if CuPy sees a GPU, else "cpu"; "cuda" without one is the user's error."""
    if device not in ("auto", "cpu", "cuda"):
        raise TinyVLLMError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise TinyVLLMError("--device cuda needs CuPy and an NVIDIA GPU (pip install -e '.[gpu]'); "
                            "use --device cpu")
    return device


def load_backend(device: str) -> ModuleType:
    if resolve_device(device) == "cuda":
        from tinyvllm.model.backend import cuda_ops
        return cuda_ops
    from tinyvllm.model.backend import numpy_ops
    return numpy_ops
