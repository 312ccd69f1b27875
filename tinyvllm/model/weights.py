"""Chapter 2: from checkpoint files to one blob of weights.

A checkpoint is one `model.safetensors` or several shards listed in `model.safetensors.index.json`.
We check every tensor's name, shape and dtype against the config, then copy them all into ONE
allocation (bf16 bits on the GPU, float32 on the CPU) and hand out named views into it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyvllm.errors import TinyVLLMError

# whole modules, not their functions: a learner's exercise plugged into a module is what runs here
from tinyvllm.formats import bf16, safetensors_format
from tinyvllm.formats.config import LlamaConfig, expected_tensor_shapes, read_json_object
from tinyvllm.model import buffers
from tinyvllm.model.buffers import Region, aligned_empty, blob_size, carve
from tinyvllm.model.kv_pool import check_memory, human_bytes

FLOAT_DTYPES = ("BF16", "F16", "F32")
CHUNK = 1 << 20  # elements widened at a time: small temporaries are reused, a 200 MB one costs page faults
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed from the config, never loaded


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory: the index's shards, or the one file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise TinyVLLMError(f"{index}: not a safetensors index (no \"weight_map\" of tensor names to file "
                                "names); re-download it")
        shards = sorted(set(weight_map.values()))
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
    found: dict[str, safetensors_format.SafetensorsFile] = {}
    for path in checkpoint_files(model_dir):
        f = safetensors_format.SafetensorsFile(path)
        for name, info in f.tensors.items():
            if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            if name in found:
                raise TinyVLLMError(f"{path}: tensor {name!r} is also in {found[name].path.name}; "
                                    "each tensor must live in exactly one shard")
            if name not in expected:
                raise TinyVLLMError(f"{path}: unexpected tensor {name!r}; the checkpoint does not match "
                                    f"its config.json ({cfg.num_hidden_layers} layers)")
            if info.shape != expected[name]:
                raise TinyVLLMError(f"{path}: tensor {name!r} has shape {list(info.shape)} but config.json "
                                    f"implies {list(expected[name])}")
            if info.dtype not in FLOAT_DTYPES:
                raise TinyVLLMError(f"{path}: tensor {name!r} has dtype {info.dtype}; expected BF16, F16 or F32")
            found[name] = f
    missing = [n for n in expected if n not in found]
    if missing:
        raise TinyVLLMError(f"{model_dir}: {len(missing)} tensors missing from the checkpoint, e.g. "
                            f"{missing[0]!r}; the download is incomplete or the config does not match")
    return {name: f.get(name) for name, f in found.items()}


def weight_kind(name: str) -> str:
    """"embedding" (in and out), "attention", "mlp" or "norm": how `info` and the figures group weights."""
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embedding"
    if ".self_attn." in name:
        return "attention"
    return "mlp" if ".mlp." in name else "norm"


def to_float32(a: np.ndarray) -> np.ndarray:
    """Any stored float dtype -> float32 (BF16 arrives as uint16 bits)."""
    return bf16.bf16_bits_to_float32(a) if a.dtype == np.uint16 else a.astype(np.float32)


@dataclass
class Weights:
    regions: list[Region]          # the memory map: name, shape, dtype, offset, bytes
    blob: object                   # the one allocation (NumPy or CuPy uint8 array)
    views: dict                    # name -> view into blob

    @property
    def nbytes(self) -> int:
        return blob_size(self.regions)


def plan_weights(cfg: LlamaConfig, dtype: str) -> list[Region]:
    """Where every weight goes in the one blob: embedding, layer by layer, final norm; starts aligned."""
    return buffers.lay_out([(name, shape, dtype) for name, shape in expected_tensor_shapes(cfg).items()])


def load_weights(model_dir: str | Path, cfg: LlamaConfig) -> Weights:
    """CPU: every weight as float32 in one NumPy blob (bf16 widened on the way in)."""
    tensors = open_checkpoint(model_dir, cfg)
    regions = plan_weights(cfg, "f32")
    blob = aligned_empty(blob_size(regions))  # ONE allocation for every weight
    views = carve(blob, regions)
    for name, view in views.items():
        copy_widened(view, tensors[name])
    return Weights(regions, blob, views)


def copy_widened(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = to_float32(src), a chunk at a time."""
    dst, src = dst.reshape(-1), src.reshape(-1)
    for i in range(0, src.size, CHUNK):
        dst[i:i + CHUNK] = to_float32(src[i:i + CHUNK])


def check_model_fits(ops, cfg: LlamaConfig, weights: list[Region], step_buffers: list[Region],
                     max_model_len: int) -> None:
    """Refuse a model this backend's memory cannot hold, before allocating any of it, naming the setting
    that shrinks its largest part: an absurd max_position_embeddings makes RoPE tables of petabytes."""
    parts = {"weights": blob_size(weights), "step buffers": blob_size(step_buffers),
             "RoPE tables": 2 * max_model_len * (cfg.head_dim // 2) * 4}  # cos and sin, float32
    fixes = {"weights": "use a smaller model, or a machine with more memory",
             "step buffers": "lower --max-num-batched-tokens",
             "RoPE tables": f"lower --max-model-len (config.json's max_position_embeddings is "
                            f"{cfg.max_position_embeddings})"}
    what = "the model (" + ", ".join(f"{name} {human_bytes(n)}" for name, n in parts.items()) + ")"
    check_memory(sum(parts.values()), ops, what, fixes[max(parts, key=parts.get)])
