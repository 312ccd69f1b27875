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

from tests.numeric import same
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
    try:
        tensors, metadata = parse_header(file_start(data) if raw is None else raw, len(data), path)
    except TinyVLLMError as e:
        pytest.fail(f"a valid file (the safetensors library reads it) was refused: {e}", pytrace=False)
    expected, expected_metadata = library_tensors(path)
    same(sorted(tensors), sorted(expected), "the tensor names (the safetensors library's, sorted)")
    for name, (dtype, shape, raw_bytes) in expected.items():
        t = tensors[name]
        same((t.name, t.dtype, tuple(t.shape)), (name, dtype, shape), f"tensor {name!r}: (name, dtype, shape)")
        assert data[t.begin:t.end] == raw_bytes, (f"tensor {name!r}: bytes [{t.begin}, {t.end}) of the file are "
                                                  "not its data (begin and end are absolute: 8 + N + data_offsets)")
    same(metadata, expected_metadata, "the __metadata__ dict")


# ---- Exercise 2.1: parse_header -------------------------------------------------------------

@pytest.mark.parametrize("trial", range(6))
def test_parse_header_matches_the_safetensors_library(impl, tmp_path, trial, rng):
    path = random_library_file(tmp_path / f"random{trial}.safetensors", rng)
    check_against_library(impl("parse_header"), path)


def test_parse_header_accepts_the_whole_file_as_raw(impl, tmp_path, rng):
    path = random_library_file(tmp_path / "whole.safetensors", rng)
    check_against_library(impl("parse_header"), path, raw=path.read_bytes())


def test_parse_header_reads_a_header_out_of_offset_order(impl, tmp_path, rng):
    """Nothing says the header lists tensors in the order of their bytes: the same file with its header's
    entries reversed (same offsets) is valid, and the library reads it. Sort by offset before looking for
    overlaps; comparing neighbours in header order would see overlaps that are not there."""
    path = random_library_file(tmp_path / "reversed.safetensors", rng)
    data = path.read_bytes()
    header = json.loads(file_start(data)[8:])
    while len([k for k in header if k != "__metadata__"]) < 3:  # enough tensors for the order to matter
        path = random_library_file(tmp_path / "reversed.safetensors", rng)
        data = path.read_bytes()
        header = json.loads(file_start(data)[8:])
    path.write_bytes(_edit_header(lambda h: json.dumps(dict(reversed(list(h.items())))))(data))
    check_against_library(impl("parse_header"), path)


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


def _by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _overlap(header: dict) -> str:
    a, b = _by_offset(header)[:2]
    header[b]["data_offsets"] = [o - 4 for o in header[b]["data_offsets"]]  # b now starts inside a
    return json.dumps(header)


def _overlap_apart_in_the_header(header: dict) -> str:
    """The first two tensors in the data overlap, with the third between them in the header: comparing
    each entry with the next one in header order misses it."""
    a, b, c = _by_offset(header)
    header[b]["data_offsets"] = [o - 4 for o in header[b]["data_offsets"]]
    return json.dumps({a: header[a], c: header[c], b: header[b]})


def _length_counts_the_prefix(data: bytes) -> bytes:
    """A file with no tensors whose length field N is 4 more than the header: 8 + N runs 4 bytes past the end,
    though N alone is less than the file's size."""
    header = b'{"__metadata__": {"format": "pt"}}'
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header) + 4) + header


CORRUPTIONS = {  # name -> (function of the file's bytes, does the message name a tensor?, what is wrong)
    "too_short": (lambda data: data[:5], False, "a 5-byte file (raw is 5 bytes: no room for the length)"),
    "length_past_end": (lambda data: struct.pack("<Q", len(data)) + data[8:], False,
                        "a header length N past the end of the file (raw is shorter than 8 + N)"),
    "length_absurd": (lambda data: struct.pack("<Q", 2**63) + data[8:], False, "a header length N of 2^63"),
    "bad_json": (_edit_header(b'{"w": {"dtype": "F32", '), False, "a header that is not valid JSON"),
    "not_utf8": (_edit_header(b'{"\xff\xfe": 1}'), False, "a header that is not UTF-8"),
    "not_an_object": (_edit_header(b"[1, 2, 3]"), False, "a header that is a JSON list, not an object"),
    "unknown_dtype": (_edit_header(lambda h: _set(h, "dtype", "Q4_K")), True, "a tensor of unknown dtype Q4_K"),
    "shape_not_ints": (_edit_header(lambda h: _set(h, "shape", [2, "three"])), True, "a shape [2, \"three\"]"),
    "offsets_out_of_bounds": (_edit_header(lambda h: _set(h, "data_offsets", [0, 10**9])), True,
                              "data_offsets past the end of the file"),
    "offsets_reversed": (_edit_header(lambda h: _set(h, "data_offsets", [16, 0])), True, "data_offsets [16, 0]"),
    "overlapping_offsets": (_edit_header(_overlap), True, "two tensors whose bytes overlap"),
    "byte_count_wrong": (_edit_header(lambda h: _set(h, "shape", [1, 2, 3, 5, 7])), True,
                         "a shape whose byte count is not end - begin"),
    "truncated_data": (lambda data: data[:-6], False, "a file cut short: its last tensor's bytes are missing"),
    "overlap_apart_in_header": (_edit_header(_overlap_apart_in_the_header), True,
                                "two tensors whose bytes overlap, not next to each other in the header"),
    "shape_with_a_boolean": (_edit_header(lambda h: _set(h, "shape", h[_first_tensor(h)]["shape"] + [True])), True,
                             "a shape ending in the JSON boolean true (not an integer, though Python counts it as 1)"),
    "length_past_end_by_4": (_length_counts_the_prefix, False,
                             "a header length N that fits the file's size but not after the 8 bytes that hold it"),
}


TENSOR_NAMES = ("model.a.weight", "model.b.weight", "model.c.weight")


def _corruptible_file(path: Path, rng: np.random.Generator) -> Path:
    """Three fresh 2-D float tensors (so overlap and truncation are always possible)."""
    tensors = {"model.a.weight": random_tensor(rng, "F32", (3, int(rng.integers(2, 9)))),
               "model.b.weight": random_tensor(rng, "BF16", (int(rng.integers(2, 9)), 4)),
               "model.c.weight": random_tensor(rng, "F16", (2, int(rng.integers(2, 9))))}
    safetensors_torch.save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_parse_header_rejects_corrupt_files(impl, tmp_path, corruption, rng):
    corrupt, names_tensor, what = CORRUPTIONS[corruption]
    path = _corruptible_file(tmp_path / f"{corruption}.safetensors", rng)
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(Exception):  # the corruption is real: the library refuses the file too
        with safe_open(str(path), framework="pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    data = path.read_bytes()
    raw = file_start(data) if len(data) >= 8 else data  # what read_header hands over
    try:
        impl("parse_header")(raw, len(data), path)
    except TinyVLLMError as e:
        message = str(e)
    except Exception as e:  # noqa: BLE001  (any other exception is the grader's finding)
        kind = type(e).__qualname__
        kind = kind if type(e).__module__ == "builtins" else f"{type(e).__module__}.{kind}"
        pytest.fail(f"{what}: raised {kind} ({e}); a corrupt file must raise TinyVLLMError", pytrace=False)
    else:
        pytest.fail(f"{what}: accepted; a corrupt file must raise TinyVLLMError", pytrace=False)
    assert str(path) in message, f"{what}: the message must contain the path exactly as passed in: {message!r}"
    assert "\n" not in message, f"{what}: the message must be one line: {message!r}"
    if names_tensor:
        assert any(name in message for name in TENSOR_NAMES), f"{what}: the message must name the tensor: {message!r}"


# ---- Exercise 2.2: bf16_bits_to_float32 -----------------------------------------------------

def torch_widen(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32).numpy()


def test_bf16_bits_to_float32_matches_torch_on_every_bit_pattern(impl, rng):
    bits = rng.permutation(np.arange(2**16, dtype=np.uint16)).reshape(256, 256)
    out = impl("bf16_bits_to_float32")(bits)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32, f"expected a float32 array, got {out.dtype}"
    assert out.shape == bits.shape, f"shape {out.shape}, expected the input's {bits.shape}"
    ref = torch_widen(bits).view(np.uint32)
    wrong = np.flatnonzero(out.view(np.uint32) != ref)  # compared as bits: NaN payloads too
    assert wrong.size == 0, (f"{wrong.size} of 65536 bit patterns widen differently, e.g. bf16 bits "
                             f"{bits.flat[wrong[0]]:#06x}: torch gives float32 bits {ref.flat[wrong[0]]:#010x}, "
                             f"yours {out.view(np.uint32).flat[wrong[0]]:#010x}")


def test_bf16_bits_to_float32_on_read_only_model_weights(impl, default_model_dir):
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        norm = f.get_tensor("model.layers.7.input_layernorm.weight")
    bits = norm.view(torch.int16).numpy().view(np.uint16)
    bits.setflags(write=False)  # weights arrive as read-only views of a memory map
    try:
        out = impl("bf16_bits_to_float32")(bits)
    except ValueError as e:
        pytest.fail(f"on read-only bits (a memory-mapped file): {e}; build a new array, leave `bits` as it is",
                    pytrace=False)
    same(out, norm.to(torch.float32).numpy(), "layer 7's input_layernorm weight, widened")


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
    assert isinstance(out, np.ndarray) and out.dtype == np.uint16, f"expected a uint16 array of bits, got {out.dtype}"
    assert out.shape == x.shape, f"shape {out.shape}, expected the input's {x.shape}"
    nan = np.isnan(x)
    wrong = np.flatnonzero(out[~nan] != ref[~nan])
    assert wrong.size == 0, (f"{wrong.size} values rounded differently, e.g. float32 bits "
                             f"{x[~nan][wrong[0]].view(np.uint32):#010x}: torch {ref[~nan][wrong[0]]:#06x}, "
                             f"yours {out[~nan][wrong[0]]:#06x}")
    lost = np.flatnonzero(~np.isnan(torch_widen(out[nan])))  # torch's NaN payload is its own choice
    assert lost.size == 0, (f"NaN must stay NaN: float32 bits {x[nan][lost[0]].view(np.uint32):#010x} became bf16 "
                            f"{out[nan][lost[0]]:#06x}")


def test_float32_to_bf16_bits_keeps_shape_and_round_trips(impl, rng):
    bits = rng.integers(0, 2**16, size=(64, 33), dtype=np.uint16)
    widened = torch_widen(bits)
    out = impl("float32_to_bf16_bits")(widened)
    assert out.shape == bits.shape, f"shape {out.shape}, expected the input's {bits.shape}"
    finite = ~np.isnan(widened)  # every bf16 is a float32, so narrowing must give the same bits back
    wrong = np.flatnonzero(out[finite] != bits[finite])
    assert wrong.size == 0, (f"{wrong.size} values that are exactly bf16 came back changed, e.g. bf16 bits "
                             f"{bits[finite][wrong[0]]:#06x} -> {out[finite][wrong[0]]:#06x}")


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
    assert ALIGN == 256, "this grader's expected layout assumes ALIGN == 256"
    arrays = [(f"t{i}", tuple(int(s) for s in rng.integers(1, 300, size=rng.integers(1, 3))),
               str(rng.choice(["bf16", "f32"]))) for i in range(rng.integers(1, 12))]
    same(impl("lay_out")(arrays), expected_layout(arrays), f"lay_out of {len(arrays)} arrays")


def test_lay_out_of_a_real_model(impl, default_model_dir):
    path = default_model_dir / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        arrays = [(name, tuple(f.get_slice(name).get_shape()), "bf16") for name in f.keys()]
    regions = impl("lay_out")(arrays)
    same(regions, expected_layout(arrays), "lay_out of the default model's 272 tensors")
    with open(path, "rb") as f:
        data_bytes = path.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]
    same(sum(r.nbytes for r in regions), data_bytes, "the regions' nbytes in all (the file's data section)")
