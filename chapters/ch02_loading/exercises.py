"""Chapter 2 exercises: read a safetensors header, widen and narrow bf16, lay out a blob.

Fill in each function, then:
    make grade CH=2                 # the graders: a score table
    make chapter-2 IMPL=student     # the chapter's checkpoint, running the engine on your functions
    .venv/bin/python -m pytest tests/test_ch02_exercises.py --impl=student -x
                                    # the graders alone: the first failure, with its traceback

Each function has the signature and docstring of the engine function it replaces (see REFERENCE).
Raise tinyvllm.errors.TinyVLLMError for a corrupt file, never a bare exception.
"""
from __future__ import annotations

import numpy as np

from tinyvllm.errors import TinyVLLMError  # noqa: F401  (what parse_header raises)
from tinyvllm.formats.safetensors_format import DTYPES, MAX_HEADER_BYTES, TensorInfo  # noqa: F401
from tinyvllm.model.buffers import ALIGN, ITEMSIZE, Region  # noqa: F401  (what lay_out needs)

REFERENCE = {
    "parse_header": "tinyvllm.formats.safetensors_format:parse_header",
    "bf16_bits_to_float32": "tinyvllm.formats.bf16:bf16_bits_to_float32",
    "float32_to_bf16_bits": "tinyvllm.formats.bf16:float32_to_bf16_bits",
    "lay_out": "tinyvllm.model.buffers:lay_out",
}


def parse_header(raw: bytes, file_size: int, path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors and metadata described by the start of a safetensors file.

    raw: the file's first bytes. read_header passes the 8-byte length N and the N bytes after it, or
         fewer where the file ends sooner; another caller may pass the whole file. So do not trust
         its length: a corrupt file gives you fewer than 8 bytes (a 5-byte file), or fewer than 8 + N
         (an N past the end of the file), and both are errors to report, not to crash on; and raw may
         run past 8 + N, where only raw[8:8 + N] is the header.
    file_size: the whole file's size in bytes, to check that every tensor's bytes are really there.
    path: used only in error messages.
    Returns ({name: TensorInfo with absolute offsets in the file}, {metadata key: value});
    raises TinyVLLMError, naming the file (and the tensor), for every way the file can be corrupt.

    Hints: struct.unpack("<Q", raw[:8]) is the length N; raw[8:8 + N] is UTF-8 JSON; the data
    section starts at byte 8 + N; "__metadata__" is not a tensor. Check: N fits in the file after
    its own 8 bytes, the JSON is an object, each dtype is in DTYPES, each shape is a list of
    non-negative integers (JSON's true is not one, though Python counts a bool as an int), each
    [begin, end] lies inside the file, end - begin equals prod(shape) * itemsize, and no two
    tensors' byte ranges overlap (the header may list them in any order).
    """
    raise NotImplementedError("Exercise 2.1: parse_header — read the 8-byte length, the JSON, "
                              "and check every entry")


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits -> float32 values (exact: every bf16 is a float32).

    Hint: bf16 is the top half of a float32. Widen to uint32, shift, and reinterpret (.view).
    """
    raise NotImplementedError("Exercise 2.2: bf16_bits_to_float32 — a 16-bit shift and a view")


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values -> uint16 bf16 bits, rounding to nearest, ties to even (as torch does).

    Hint: look at the float32 bits as uint32. Adding 0x7FFF plus the lowest kept bit before
    dropping the low 16 bits rounds to nearest, ties to even. NaN must stay NaN.
    """
    raise NotImplementedError("Exercise 2.3: float32_to_bf16_bits — round to nearest even, keep NaN")


def lay_out(arrays: list[tuple[str, tuple[int, ...], str]]) -> list[Region]:
    """Place (name, shape, dtype) arrays back to back, each start rounded up to ALIGN bytes.

    dtype is "bf16" or "f32" (ITEMSIZE gives the bytes per element). The first array starts at 0;
    each next one at the first multiple of ALIGN at or after the end of the previous one.
    """
    raise NotImplementedError("Exercise 2.4: lay_out — sizes from shapes, offsets rounded up to ALIGN")
