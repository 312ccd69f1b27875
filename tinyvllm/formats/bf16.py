"""Chapter 2: bfloat16 is the top half of a float32.

bf16 keeps float32's sign and 8-bit exponent and the top 7 mantissa bits, so widening is a 16-bit
shift and narrowing is a rounded truncation. NumPy has no bf16 dtype: we hold the bits in uint16.
"""
import numpy as np


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits -> float32 values (exact: every bf16 is a float32)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values -> uint16 bf16 bits, rounding to nearest, ties to even (as torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = np.uint32(0x7FFF) + ((u >> 16) & 1)  # ties go to the even neighbour
    rounded = ((u + rounding) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)  # keep NaN a NaN after rounding
