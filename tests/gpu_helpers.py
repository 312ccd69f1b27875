"""Helpers for the GPU tests: skip cleanly without a GPU, bf16 round trips, NaN-poisoned outputs."""
from __future__ import annotations

import numpy as np
import pytest

from tinyvllm.formats.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from tinyvllm.model.backend import cuda_available

requires_gpu = pytest.mark.skipif(not cuda_available(), reason="needs an NVIDIA GPU and CuPy (make test-gpu)")
NAN_BF16 = np.uint16(0x7FC0)


def bf16_pair(rng: np.random.Generator, shape, scale: float = 1.0):
    """Random values exactly representable in bf16: (float32 for the twin, bf16 bits on the GPU)."""
    import cupy as cp
    bits = float32_to_bf16_bits(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
    return bf16_bits_to_float32(bits), cp.asarray(bits)


def nan_bf16(shape):
    """A bf16 output buffer full of NaN: an element the kernel forgets to write fails the test."""
    import cupy as cp
    return cp.full(shape, NAN_BF16, dtype=cp.uint16)


def from_bf16(a) -> np.ndarray:
    import cupy as cp
    return bf16_bits_to_float32(cp.asnumpy(a))
