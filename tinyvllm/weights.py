"""Chapter 2: from checkpoint files to one blob of weights.

A checkpoint is one `model.safetensors` or several shards listed in `model.safetensors.index.json`.
We check every tensor's name, shape and dtype against the config, then copy them all into ONE
allocation (bf16 bits on the GPU, float32 on the CPU) and hand out named views into it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.bf16 import bf16_bits_to_float32
from tinyvllm.buffers import Region, blob_size, carve, lay_out
from tinyvllm.config import LlamaConfig, expected_tensor_shapes
from tinyvllm.errors import TinyVLLMError
from tinyvllm.safetensors_format import SafetensorsFile

FLOAT_DTYPES = ("BF16", "F16", "F32")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed from the config, never loaded


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory: the index's shards, or the one file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise TinyVLLMError(f"{index}: not a valid safetensors index ({e!r})") from None
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise TinyVLLMError(f"{index} lists {missing[0]}, which is missing; finish the download")
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise TinyVLLMError(f"{model_dir} has no *.safetensors file; tinyvllm reads safetensors "
                            "checkpoints (convert .bin/.pth checkpoints with transformers first)")
    return files


def open_checkpoint(model_dir: str | Path, cfg: LlamaConfig) -> dict[str, np.ndarray]:
    """Zero-copy views of every tensor the config expects, after checking names, shapes and dtypes."""
    model_dir, expected = Path(model_dir), expected_tensor_shapes(cfg)
    found: dict[str, tuple[SafetensorsFile, str]] = {}
    for path in checkpoint_files(model_dir):
        f = SafetensorsFile(path)
        for name, info in f.tensors.items():
            if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            if name not in expected:
                raise TinyVLLMError(f"{path}: unexpected tensor {name!r}; the checkpoint does not match "
                                    f"its config.json ({cfg.num_hidden_layers} layers)")
            if info.shape != expected[name]:
                raise TinyVLLMError(f"{path}: tensor {name!r} has shape {list(info.shape)} but config.json "
                                    f"implies {list(expected[name])}")
            if info.dtype not in FLOAT_DTYPES:
                raise TinyVLLMError(f"{path}: tensor {name!r} has dtype {info.dtype}; expected BF16, F16 or F32")
            found[name] = (f, name)
    missing = [n for n in expected if n not in found]
    if missing:
        raise TinyVLLMError(f"{model_dir}: {len(missing)} tensors missing from the checkpoint, e.g. "
                            f"{missing[0]!r}; the download is incomplete or the config does not match")
    return {name: f.get(key) for name, (f, key) in found.items()}


def to_float32(a: np.ndarray) -> np.ndarray:
    """Any stored float dtype -> float32 (BF16 arrives as uint16 bits)."""
    return bf16_bits_to_float32(a) if a.dtype == np.uint16 else a.astype(np.float32)


@dataclass
class Weights:
    regions: list[Region]          # the memory map: name, shape, dtype, offset, bytes
    blob: object                   # the one allocation (NumPy or CuPy uint8 array)
    views: dict                    # name -> view into blob

    @property
    def nbytes(self) -> int:
        return blob_size(self.regions)


def plan_weights(cfg: LlamaConfig, dtype: str) -> list[Region]:
    return lay_out([(name, shape, dtype) for name, shape in expected_tensor_shapes(cfg).items()])


def load_weights(model_dir: str | Path, cfg: LlamaConfig) -> Weights:
    """CPU: every weight as float32 in one NumPy blob (bf16 widened on the way in)."""
    tensors = open_checkpoint(model_dir, cfg)
    regions = plan_weights(cfg, "f32")
    blob = np.empty(blob_size(regions), dtype=np.uint8)
    views = carve(blob, regions)
    for name, view in views.items():
        view[...] = to_float32(tensors[name])
    return Weights(regions, blob, views)
