"""Chapter 2 graders: the safetensors header, bf16 widening and narrowing, the blob layout.

References are independent of the code under test: the `safetensors` library (which also writes the
files), torch's bfloat16 conversions, and the layout rule worked out by hand from the docstring.
Inputs are fresh random files and values on every run.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.errors import TinyVLLMError
from tinyvllm.model.buffers import ALIGN, Region

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

pytestmark = pytest.mark.ch2

TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                "U8": torch.uint8, "BOOL": torch.bool}


def random_tensor(rng: np.random.Generator, tag: str, shape: tuple[int, ...]):
    """A torch tensor of dtype `tag` with random values."""
    if tag == "BOOL":
        return torch.from_numpy(np.asarray(rng.random(shape) < 0.5))
    if tag.startswith(("I", "U")):
        return torch.from_numpy(rng.integers(-100, 100, shape)).to(TORCH_DTYPES[tag])
    return torch.from_numpy(rng.standard_normal(shape)).to(TORCH_DTYPES[tag])


def random_library_file(path: Path, rng: np.random.Generator) -> Path:
    """A file written by the safetensors library: random names, dtypes, shapes (scalars and empties too)."""
    tensors = {}
    for i in range(rng.integers(1, 8)):
        shape = tuple(int(s) for s in rng.integers(0 if i == 0 else 1, 6, size=rng.integers(0, 4)))
        tensors[f"layer.{i}.w{rng.integers(1000)}"] = random_tensor(rng, rng.choice(list(TORCH_DTYPES)), shape)
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt", "seed": str(rng.integers(9999))})
    return path


def library_tensors(path: Path) -> tuple[dict[str, tuple[str, tuple, bytes]], dict]:
    """{name: (dtype tag, shape, raw bytes)} and the metadata, as the safetensors library reads them."""
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            s = f.get_slice(name)
            raw = f.get_tensor(name).reshape(-1).view(torch.uint8).numpy().tobytes()
            out[name] = (s.get_dtype(), tuple(s.get_shape()), raw)
        return out, f.metadata() or {}


def file_start(data: bytes) -> bytes:
    """What the engine hands parse_header: the 8-byte length and the header it announces."""
    return data[:8 + struct.unpack("<Q", data[:8])[0]]


def check_against_library(parse_header, path: Path, raw: bytes | None = None) -> None:
    data = path.read_bytes()
    tensors, metadata = parse_header(file_start(data) if raw is None else raw, len(data), path)
    expected, expected_metadata = library_tensors(path)
    assert set(tensors) == set(expected), "tensor names differ from the safetensors library's"
    for name, (dtype, shape, raw_bytes) in expected.items():
        t = tensors[name]
        assert (t.name, t.dtype, tuple(t.shape)) == (name, dtype, shape), name
        assert data[t.begin:t.end] == raw_bytes, f"{name}: begin/end do not point at its bytes"
    assert metadata == expected_metadata


# ---- Exercise 2.1: parse_header -------------------------------------------------------------

@pytest.mark.parametrize("trial", range(6))
def test_parse_header_matches_the_safetensors_library(impl, tmp_path, trial, rng):
    path = random_library_file(tmp_path / f"random{trial}.safetensors", rng)
    check_against_library(impl("parse_header"), path)


def test_parse_header_accepts_the_whole_file_as_raw(impl, tmp_path, rng):
    path = random_library_file(tmp_path / "whole.safetensors", rng)
    check_against_library(impl("parse_header"), path, raw=path.read_bytes())


def test_parse_header_reads_the_default_model(impl, default_model_dir):
    check_against_library(impl("parse_header"), default_model_dir / "model.safetensors")


def _edit_header(edit):
    """A corruption that rewrites the JSON header (keeping the length field honest)."""
    def corrupt(data: bytes) -> bytes:
        header = json.loads(file_start(data)[8:])
        body = data[len(file_start(data)):]
        raw = edit(header).encode() if callable(edit) else edit
        raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the library writes it
        return struct.pack("<Q", len(raw)) + raw + body
    return corrupt


def _first_tensor(header: dict) -> str:  # the tensor at data offset 0
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _set(header: dict, key: str, value, name: str | None = None) -> str:
    header[name or _first_tensor(header)][key] = value
    return json.dumps(header)


def _overlap(header: dict) -> str:
    a, b = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    header[b]["data_offsets"] = [o - 4 for o in header[b]["data_offsets"]]  # b now starts inside a
    return json.dumps(header)


CORRUPTIONS = {  # name -> (function of the file's bytes, does the message name a tensor?)
    "too_short": (lambda data: data[:5], False),
    "length_past_end": (lambda data: struct.pack("<Q", len(data)) + data[8:], False),
    "length_absurd": (lambda data: struct.pack("<Q", 2**63) + data[8:], False),
    "bad_json": (_edit_header(b'{"w": {"dtype": "F32", '), False),
    "not_utf8": (_edit_header(b'{"\xff\xfe": 1}'), False),
    "not_an_object": (_edit_header(b"[1, 2, 3]"), False),
    "unknown_dtype": (_edit_header(lambda h: _set(h, "dtype", "Q4_K")), True),
    "shape_not_ints": (_edit_header(lambda h: _set(h, "shape", [2, "three"])), True),
    "offsets_out_of_bounds": (_edit_header(lambda h: _set(h, "data_offsets", [0, 10**9])), True),
    "offsets_reversed": (_edit_header(lambda h: _set(h, "data_offsets", [16, 0])), True),
    "overlapping_offsets": (_edit_header(_overlap), True),
    "byte_count_wrong": (_edit_header(lambda h: _set(h, "shape", [1, 2, 3, 5, 7])), True),
    "truncated_data": (lambda data: data[:-6], False),
}


def _corruptible_file(path: Path, rng: np.random.Generator) -> Path:
    """Two fresh 2-D float tensors (so overlap and truncation are always possible)."""
    tensors = {"model.a.weight": random_tensor(rng, "F32", (3, int(rng.integers(2, 9)))),
               "model.b.weight": random_tensor(rng, "BF16", (int(rng.integers(2, 9)), 4))}
    safetensors_torch.save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_parse_header_rejects_corrupt_files(impl, tmp_path, corruption, rng):
    corrupt, names_tensor = CORRUPTIONS[corruption]
    path = _corruptible_file(tmp_path / f"{corruption}.safetensors", rng)
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(Exception):  # the corruption is real: the library refuses the file too
        with safe_open(str(path), framework="pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    data = path.read_bytes()
    with pytest.raises(TinyVLLMError) as err:
        impl("parse_header")(file_start(data) if len(data) >= 8 else data, len(data), path)
    message = str(err.value)
    assert str(path) in message, f"the message should name the file: {message}"
    assert "\n" not in message, "one line, please"
    if names_tensor:
        assert "model.a.weight" in message or "model.b.weight" in message, f"name the tensor: {message}"


# ---- Exercise 2.2: bf16_bits_to_float32 -----------------------------------------------------

def torch_widen(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32).numpy()


def test_bf16_bits_to_float32_matches_torch_on_every_bit_pattern(impl, rng):
    bits = rng.permutation(np.arange(2**16, dtype=np.uint16)).reshape(256, 256)
    out = impl("bf16_bits_to_float32")(bits)
    assert out.dtype == np.float32 and out.shape == bits.shape
    assert np.array_equal(out.view(np.uint32), torch_widen(bits).view(np.uint32))  # NaN payloads too


def test_bf16_bits_to_float32_on_read_only_model_weights(impl, default_model_dir):
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        norm = f.get_tensor("model.layers.7.input_layernorm.weight")
    bits = norm.view(torch.int16).numpy().view(np.uint16)
    bits.setflags(write=False)  # weights arrive as read-only views of a memory map
    out = impl("bf16_bits_to_float32")(bits)
    assert np.array_equal(out, norm.to(torch.float32).numpy())


# ---- Exercise 2.3: float32_to_bf16_bits -----------------------------------------------------

def hard_float32s(rng: np.random.Generator) -> np.ndarray:
    """Random bit patterns (every exponent), exact ties, subnormals, infinities, NaNs, zeros."""
    u = rng.integers(0, 2**32, size=400_000, dtype=np.uint64).astype(np.uint32)
    u[:50_000] = (u[:50_000] & 0xFFFF0000) | 0x8000              # exactly halfway: ties to even
    u[50_000:60_000] &= 0x807FFFFF                                # subnormals (exponent 0)
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F7FFFFF,
                        0x00000000, 0x80000000, 0x00000001, 0x3F808000, 0x3F818000], dtype=np.uint32)
    return np.concatenate([special, u]).view(np.float32)


def test_float32_to_bf16_bits_matches_torch_rounding(impl, rng):
    x = hard_float32s(rng)
    out = impl("float32_to_bf16_bits")(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert out.dtype == np.uint16 and out.shape == x.shape
    nan = np.isnan(x)
    wrong = np.flatnonzero(out[~nan] != ref[~nan])
    assert wrong.size == 0, (f"{wrong.size} values rounded differently, e.g. float32 bits "
                             f"{x[~nan][wrong[0]].view(np.uint32):#010x}: torch {ref[~nan][wrong[0]]:#06x}, "
                             f"yours {out[~nan][wrong[0]]:#06x}")
    assert np.isnan(torch_widen(out[nan])).all(), "NaN must stay NaN"  # torch's NaN payload is its own choice


def test_float32_to_bf16_bits_keeps_shape_and_round_trips(impl, rng):
    bits = rng.integers(0, 2**16, size=(64, 33), dtype=np.uint16)
    widened = torch_widen(bits)
    out = impl("float32_to_bf16_bits")(widened)
    assert out.shape == bits.shape
    finite = ~np.isnan(widened)  # every bf16 is a float32, so narrowing must give the same bits back
    assert np.array_equal(out[finite], bits[finite])


# ---- Exercise 2.4: lay_out ------------------------------------------------------------------

def expected_layout(arrays) -> list[Region]:
    """The rule from the docstring, worked out by hand."""
    regions, end = [], 0
    for name, shape, dtype in arrays:
        offset = (end + 255) // 256 * 256
        nbytes = int(np.prod(shape)) * {"bf16": 2, "f32": 4}[dtype]
        regions.append(Region(name, tuple(shape), dtype, offset, nbytes))
        end = offset + nbytes
    return regions


@pytest.mark.parametrize("trial", range(4))
def test_lay_out_aligns_every_start(impl, trial, rng):
    assert ALIGN == 256
    arrays = [(f"t{i}", tuple(int(s) for s in rng.integers(1, 300, size=rng.integers(1, 3))),
               str(rng.choice(["bf16", "f32"]))) for i in range(rng.integers(1, 12))]
    assert impl("lay_out")(arrays) == expected_layout(arrays)


def test_lay_out_of_a_real_model(impl, default_model_dir):
    path = default_model_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        arrays = [(name, tuple(f.get_slice(name).get_shape()), "bf16") for name in f.keys()]
    regions = impl("lay_out")(arrays)
    assert regions == expected_layout(arrays)
    with open(path, "rb") as f:
        data_bytes = path.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]
    assert sum(r.nbytes for r in regions) == data_bytes  # the payload is the file's data section
