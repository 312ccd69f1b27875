"""Chapter 2: the safetensors file format, read and written from scratch.

    [8 bytes: N, little-endian u64][N bytes: JSON header][data: tensors back to back]

The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, offsets
relative to the start of the data section, plus an optional "__metadata__" dict of strings.
Reading is a memory map: a tensor is a zero-copy NumPy view of the file's bytes.
(Named `safetensors_format` so it never shadows the `safetensors` library we verify against.)
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.errors import TinyVLLMError

# safetensors dtype tag -> NumPy dtype of the stored bits (BF16 stays as raw uint16 bits)
DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"),
          "F64": np.dtype("<f8"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
          "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the library's own limit: a larger "length" means a corrupt file


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str               # the safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int               # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One .safetensors file: its parsed, validated header and zero-copy views of its tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors, self.metadata = read_header(self.path)
        # mode="r": the OS pages bytes in on first touch, and nobody can write through a view
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if self.tensors else None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the tensor's bytes with its dtype and shape (BF16 -> uint16 bits)."""
        t = self.tensors[name]
        return self._map[t.begin:t.end].view(DTYPES[t.dtype]).reshape(t.shape)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Read just the start of the file (the length and the header it announces) and parse it."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) == 8:  # read what the length announces; parse_header checks it is really there
            raw += f.read(min(struct.unpack("<Q", raw)[0], MAX_HEADER_BYTES))
    # through the module, so a learner's parse_header plugged into this module is the one that runs
    return parse_header(raw, size, path)


def parse_header(raw: bytes, file_size: int, path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors and metadata described by the start of a safetensors file.

    raw: the file's first bytes: read_header passes the 8-byte length N and the N bytes after it, or fewer
         where the file ends sooner (fewer than 8, or than 8 + N: both reported); the whole file is fine
         too (only raw[8:8 + N] is the header).
    file_size: the whole file's size in bytes, to check that every tensor's bytes are really there.
    path: used only in error messages.
    Returns ({name: TensorInfo with absolute offsets in the file}, {metadata key: value});
    raises TinyVLLMError, naming the file (and the tensor), for every way the file can be corrupt.
    """
    if len(raw) < 8 or file_size < 8:
        raise TinyVLLMError(f"{path}: {file_size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > min(file_size - 8, MAX_HEADER_BYTES) or len(raw) < 8 + n:
        raise TinyVLLMError(f"{path}: header length {n} runs past the end of the file "
                            f"({file_size} bytes); the file is truncated or not safetensors")
    try:
        header = json.loads(raw[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TinyVLLMError(f"{path}: header is not valid JSON ({e}); the file is corrupt") from None
    except RecursionError:  # Python's parser recurses once per [ or {: thousands deep exhaust the stack
        raise TinyVLLMError(f"{path}: header is JSON nested too deeply to be a tensor list; the file is "
                            "corrupt") from None
    if not isinstance(header, dict):
        raise TinyVLLMError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise TinyVLLMError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + n
    tensors = {name: _tensor_info(path, name, entry, data_start, file_size) for name, entry in header.items()}
    _check_no_overlap(path, tensors)
    return tensors, metadata


def _tensor_info(path, name: str, entry, data_start: int, file_size: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise TinyVLLMError(f"{where}: entry needs dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise TinyVLLMError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
        raise TinyVLLMError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise TinyVLLMError(f"{where}: data_offsets {offsets!r} must be [begin, end] with 0 <= begin <= end")
    begin, end = data_start + offsets[0], data_start + offsets[1]
    if end > file_size:
        raise TinyVLLMError(f"{where}: data_offsets {offsets} run past the end of the file "
                            f"({file_size - data_start} data bytes); the file is truncated")
    expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise TinyVLLMError(f"{where}: holds {end - begin} bytes but shape {shape} x {dtype} "
                            f"needs {expected}")
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _check_no_overlap(path, tensors: dict[str, TensorInfo]) -> None:
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise TinyVLLMError(f"{path}: tensors {a!r} and {b!r} overlap in the data section")


def write_safetensors(path: str | Path, tensors: dict[str, tuple[str, np.ndarray]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write {name: (dtype tag, array)} atomically (temp file + rename); "BF16" takes uint16 bits."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, array) in tensors.items():
        if dtype == "BF16" and array.dtype != np.uint16:
            raise TypeError(f"{name}: BF16 takes uint16 bits (bf16.float32_to_bf16_bits), got {array.dtype}")
        nbytes = array.size * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so the data section starts 8-byte aligned, like the library
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for dtype, array in tensors.values():
            f.write(np.ascontiguousarray(array, dtype=DTYPES[dtype]).reshape(-1).view(np.uint8))
    os.replace(tmp, path)
