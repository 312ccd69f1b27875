"""Our safetensors reader and writer against the `safetensors` library, and every way a file can be wrong.

Byte-identical on real files (the default model, files the library wrote, files we wrote), zero-copy
views of a memory map, one-line TinyVLLMErrors that name the file and the tensor.
"""
from __future__ import annotations

import json
import struct
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.config import LlamaConfig, expected_tensor_shapes
from tinyvllm.formats.safetensors_format import SafetensorsFile, write_safetensors
from tinyvllm.model.weights import open_checkpoint

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

TORCH = {"F16": torch.float16, "F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64,
         "I32": torch.int32, "U8": torch.uint8, "F64": torch.float64, "BOOL": torch.bool}


def as_bytes(t) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def library_read(path: Path) -> tuple[dict[str, tuple[str, list[int], bytes]], dict]:
    with safe_open(str(path), framework="pt") as f:
        return ({k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape(), as_bytes(f.get_tensor(k)))
                 for k in f.keys()}, f.metadata() or {})


def our_read(path: Path) -> tuple[dict[str, tuple[str, list[int], bytes]], dict]:
    f = SafetensorsFile(path)
    return ({k: (t.dtype, list(t.shape), f.get(k).tobytes()) for k, t in f.tensors.items()}, f.metadata)


def random_torch(rng: np.random.Generator, tag: str, shape) -> "torch.Tensor":
    if tag == "BOOL":
        return torch.from_numpy(np.asarray(rng.random(shape) < 0.5))
    if tag in ("I64", "I32", "U8"):
        return torch.from_numpy(rng.integers(0, 120, shape)).to(TORCH[tag])
    return torch.from_numpy(np.asarray(rng.standard_normal(shape) * 100)).to(TORCH[tag])


# ---- byte-identical to the library ----------------------------------------------------------

def test_default_model_is_byte_identical_to_the_library(default_model_dir):
    path = default_model_dir / "model.safetensors"
    ours = SafetensorsFile(path)
    with safe_open(str(path), framework="pt") as lib:
        assert set(ours.tensors) == set(lib.keys())
        assert ours.metadata == lib.metadata()
        for name in lib.keys():
            ref = lib.get_tensor(name)
            mine = ours.get(name)
            assert mine.shape == tuple(ref.shape) and ours.tensors[name].dtype == "BF16"
            assert np.array_equal(mine, ref.view(torch.int16).numpy().view(np.uint16)), name  # bf16 bits


def test_file_written_by_the_library_reads_identically(tmp_path, rng):
    tensors = {"a.f16": random_torch(rng, "F16", (3, 5)), "b.f32": random_torch(rng, "F32", (7,)),
               "c.bf16": random_torch(rng, "BF16", (2, 3, 4)), "d.i64": random_torch(rng, "I64", (4, 1)),
               "e.scalar": random_torch(rng, "F32", ())}
    path = tmp_path / "library.safetensors"
    safetensors_torch.save_file(tensors, str(path), metadata={"format": "pt", "note": "written by the library"})
    ours = SafetensorsFile(path)
    assert ours.metadata == {"format": "pt", "note": "written by the library"}
    assert our_read(path) == library_read(path)
    assert ours.get("a.f16").dtype == np.float16 and np.array_equal(ours.get("a.f16"), tensors["a.f16"].numpy())
    assert np.array_equal(ours.get("d.i64"), tensors["d.i64"].numpy())
    assert np.array_equal(ours.get("c.bf16"), tensors["c.bf16"].view(torch.int16).numpy().view(np.uint16))


def test_file_written_by_us_is_read_by_the_library(tmp_path, rng):
    bf16 = rng.integers(0, 2**16, (5, 6), dtype=np.uint16)
    tensors = {"x.f16": ("F16", rng.standard_normal((4, 4)).astype(np.float16)),
               "x.f32": ("F32", rng.standard_normal(9).astype(np.float32)),
               "x.bf16": ("BF16", bf16), "x.i64": ("I64", rng.integers(-9, 9, (2, 3)))}
    path = tmp_path / "ours.safetensors"
    write_safetensors(path, tensors, {"format": "pt", "by": "tinyvllm"})
    lib, metadata = library_read(path)
    assert metadata == {"format": "pt", "by": "tinyvllm"}
    for name, (tag, array) in tensors.items():
        dtype, shape, raw = lib[name]
        assert (dtype, shape) == (tag, list(array.shape))
        assert raw == array.tobytes()


def test_views_are_zero_copy_and_read_only(default_model_dir):
    path = default_model_dir / "model.safetensors"
    w = SafetensorsFile(path).get("model.layers.3.mlp.up_proj.weight")
    base = w
    while isinstance(base.base, np.ndarray):  # walk view -> view -> ... -> the map of the whole file
        base = base.base
    assert isinstance(base, np.memmap) and base.size == path.stat().st_size
    assert np.shares_memory(w, base) and not w.flags.writeable


TAGS = st.sampled_from(["F16", "F32", "BF16", "I64", "I32", "U8", "F64", "BOOL"])
SHAPES = st.lists(st.integers(0, 5), max_size=3).map(tuple)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(TAGS, SHAPES), min_size=1, max_size=5), st.integers(0, 2**32 - 1))
def test_random_files_round_trip_both_ways(specs, seed):
    rng = np.random.default_rng(seed)
    tensors = {f"t{i}.{tag}": random_torch(rng, tag, shape) for i, (tag, shape) in enumerate(specs)}
    with tempfile.TemporaryDirectory() as tmp:
        theirs, ours = Path(tmp) / "theirs.safetensors", Path(tmp) / "ours.safetensors"
        safetensors_torch.save_file(tensors, str(theirs), metadata={"seed": str(seed)})
        assert our_read(theirs) == library_read(theirs)  # library writes -> we read
        arrays = {name: (name.split(".")[1], t.view(torch.int16).numpy().view(np.uint16)  # bf16 as its bits
                         if t.dtype == torch.bfloat16 else t.numpy()) for name, t in tensors.items()}
        write_safetensors(ours, arrays, {"seed": str(seed)})
        assert library_read(ours) == library_read(theirs)  # we write -> library reads the same


# ---- corrupt files ----------------------------------------------------------------------------

def small_file(path: Path, rng: np.random.Generator) -> Path:
    write_safetensors(path, {"w.first": ("F32", rng.standard_normal((4, 3)).astype(np.float32)),
                             "w.second": ("BF16", rng.integers(0, 2**16, (2, 8), dtype=np.uint16))})
    return path


def rewrite_header(path: Path, edit) -> None:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    raw = edit if isinstance(edit, bytes) else json.dumps(edit(header) or header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _entry(key, value):
    return lambda h: h["w.second"].update({key: value})


CORRUPT = {  # name -> (how to corrupt the file, words the one-line message must contain)
    "header_length_past_end": (lambda p: p.write_bytes(struct.pack("<Q", 10**6) + p.read_bytes()[8:]),
                               ["header length", "past the end"]),
    "bad_json": (lambda p: rewrite_header(p, b'{"w.first": {"dtype": '), ["not valid JSON"]),
    "header_not_an_object": (lambda p: rewrite_header(p, b'"just a string"'), ["JSON object"]),
    "offsets_out_of_bounds": (lambda p: rewrite_header(p, _entry("data_offsets", [48, 4096])),
                              ["w.second", "past the end"]),
    "overlapping_offsets": (lambda p: rewrite_header(p, _entry("data_offsets", [40, 72])),
                            ["w.first", "w.second", "overlap"]),
    "byte_count_wrong": (lambda p: rewrite_header(p, _entry("shape", [3, 8])), ["w.second", "needs 48"]),
    "unknown_dtype": (lambda p: rewrite_header(p, _entry("dtype", "F4")), ["w.second", "unknown dtype"]),
    "truncated_file": (lambda p: p.write_bytes(p.read_bytes()[:-10]), ["w.second", "truncated"]),
    "empty_file": (lambda p: p.write_bytes(b""), ["too short"]),
}


@pytest.mark.parametrize("case", CORRUPT)
def test_every_corruption_is_one_line_naming_the_file(tmp_path, case, rng):
    corrupt, words = CORRUPT[case]
    path = small_file(tmp_path / f"{case}.safetensors", rng)
    corrupt(path)
    with pytest.raises(TinyVLLMError) as err:
        SafetensorsFile(path)
    message = str(err.value)
    assert str(path) in message and "\n" not in message
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
    with pytest.raises(Exception):  # the library agrees that the file is broken
        with safe_open(str(path), framework="pt") as f:
            [f.get_tensor(k) for k in f.keys()]


# ---- open_checkpoint: names and shapes against the config -------------------------------------

TINY = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=True)


def tiny_checkpoint(model_dir: Path, shards: int = 1, drop: str | None = None, extra: str | None = None,
                    reshape: str | None = None) -> Path:
    """config.json + safetensors written by the library (one file, or shards + index.json)."""
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    shapes = {**expected_tensor_shapes(TINY), **({extra: (3,)} if extra else {})}
    if reshape:
        shapes[reshape] = (shapes[reshape][0] + 1, *shapes[reshape][1:])
    weights = torch.Generator().manual_seed(0)  # the values do not matter here, only names and shapes
    tensors = {n: torch.randn(s, generator=weights).to(torch.bfloat16) for n, s in shapes.items() if n != drop}
    if shards == 1:
        safetensors_torch.save_file(tensors, str(model_dir / "model.safetensors"))
        return model_dir
    names, weight_map = list(tensors), {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        safetensors_torch.save_file(part, str(model_dir / file))
        weight_map.update(dict.fromkeys(part, file))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return model_dir


def test_tiny_checkpoints_open(tmp_path):
    for shards in (1, 3):
        views = open_checkpoint(tiny_checkpoint(tmp_path / f"s{shards}", shards), TINY)
        assert {n: v.shape for n, v in views.items()} == expected_tensor_shapes(TINY)


CHECKPOINT_ERRORS = {  # name -> (tiny_checkpoint arguments, words the message must contain)
    "missing_tensor": (dict(drop="model.layers.1.mlp.up_proj.weight"),
                       ["model.layers.1.mlp.up_proj.weight", "missing"]),
    "unexpected_tensor": (dict(extra="model.layers.2.input_layernorm.weight"),
                          ["model.safetensors", "model.layers.2.input_layernorm.weight", "unexpected"]),
    "wrong_shape": (dict(reshape="model.layers.0.self_attn.k_proj.weight"),
                    ["model.safetensors", "model.layers.0.self_attn.k_proj.weight", "[5, 8]", "[4, 8]"]),
}


@pytest.mark.parametrize("case", CHECKPOINT_ERRORS)
def test_checkpoint_must_match_its_config(tmp_path, case):
    kwargs, words = CHECKPOINT_ERRORS[case]
    with pytest.raises(TinyVLLMError) as err:
        open_checkpoint(tiny_checkpoint(tmp_path / "m", **kwargs), TINY)
    for word in words:
        assert word in str(err.value), f"{word!r} missing from: {err.value}"


def test_sharded_checkpoint_with_a_missing_shard(tmp_path):
    model_dir = tiny_checkpoint(tmp_path / "m", shards=3)
    (model_dir / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(TinyVLLMError, match="model-00002-of-00003.safetensors.*missing"):
        open_checkpoint(model_dir, TINY)


def test_tensor_in_two_shards(tmp_path):
    model_dir = tiny_checkpoint(tmp_path / "m", shards=2)
    extra = {"model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}
    safetensors_torch.save_file(extra, str(model_dir / "model-extra.safetensors"))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.input_layernorm.weight"] = "model-extra.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TinyVLLMError, match="model.norm.weight.*exactly one shard"):
        open_checkpoint(model_dir, TINY)


def test_config_of_another_size_is_caught(tmp_path):
    model_dir = tiny_checkpoint(tmp_path / "m")
    with pytest.raises(TinyVLLMError, match="shape"):
        open_checkpoint(model_dir, replace(TINY, hidden_size=12, head_dim=6))


def test_integer_weights_are_refused(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    tensors = {n: torch.zeros(s, dtype=torch.int32) for n, s in expected_tensor_shapes(TINY).items()}
    safetensors_torch.save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(TinyVLLMError, match="dtype I32"):
        open_checkpoint(model_dir, TINY)


def test_directory_without_safetensors(tmp_path):
    with pytest.raises(TinyVLLMError, match="no \\*.safetensors"):
        open_checkpoint(tmp_path, TINY)
