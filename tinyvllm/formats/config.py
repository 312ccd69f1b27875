"""Chapter 1: the handful of numbers that define a Llama model, read from its `config.json`.

Every shape in the engine is derived from this one object, so a checkpoint of another size
(SmolLM2-135M, Llama 3.2 1B/3B, Llama 3.1 8B) needs no code change.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from tinyvllm.errors import TinyVLLMError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor", "low_freq_factor", ...} or None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:  # width of the Q projection's output
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:  # width of the K (and V) projection's output: GQA makes it smaller
        return self.num_key_value_heads * self.head_dim

    def context_window(self, asked: int | None = None) -> int:
        """The context window asked for (None: the model's), at most the model's: the one place it is capped."""
        return min(asked or self.max_position_embeddings, self.max_position_embeddings)

    def to_hf_dict(self) -> dict:
        """The config.json that transformers' LlamaForCausalLM reads."""
        d = asdict(self)
        eos = list(d.pop("eos_token_ids"))
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
                 hidden_act="silu", attention_bias=False, mlp_bias=False,
                 eos_token_id=eos[0] if len(eos) == 1 else eos)
        return d


def config_from_dict(d: dict, where: str = "config.json") -> LlamaConfig:
    """Validate a HF config dict and keep the fields the engine uses; `where` names it in errors."""
    d = {k: v for k, v in d.items() if v is not None}  # null means "not set", as in transformers
    archs = d.get("architectures") or [d.get("model_type", "?")]
    if not isinstance(archs, list):
        raise TinyVLLMError(f"{where}: architectures must be a list like [\"LlamaForCausalLM\"], got {archs!r}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise TinyVLLMError(f"{where}: architecture {archs[0]!r} is not supported; tinyvllm runs "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)} checkpoints (Llama 3.x, SmolLM2)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    if missing:
        raise TinyVLLMError(f"{where}: missing {', '.join(missing)}; is this a HF Llama config.json?")
    hidden, heads = _size(d, "hidden_size", where), _size(d, "num_attention_heads", where)
    kv_heads = _size(d, "num_key_value_heads", where, default=heads)  # none given: one K/V head per head
    if heads % kv_heads:
        raise TinyVLLMError(f"{where}: num_attention_heads={heads} is not a multiple of "
                            f"num_key_value_heads={kv_heads}")
    tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):  # bool("false") would be True
        raise TinyVLLMError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
    vocab = _size(d, "vocab_size", where)
    bos = d.get("bos_token_id")
    if bos is not None and not is_token_id(bos):
        raise TinyVLLMError(f"{where}: bos_token_id must be a token id (an integer >= 0), got {bos!r}")
    _check_in_vocab([] if bos is None else [bos], vocab, "bos_token_id", where)
    eos = _token_ids(d.get("eos_token_id"), "eos_token_id", where)
    _check_in_vocab(eos, vocab, "eos_token_id", where)
    params = _rope_parameters(d, where)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=_size(d, "intermediate_size", where),
        num_hidden_layers=_size(d, "num_hidden_layers", where),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=_head_dim(d, hidden, heads, where),
        rope_theta=_positive_number(d, "rope_theta", where, default=params.get("rope_theta", 10000.0)),
        rms_norm_eps=_positive_number(d, "rms_norm_eps", where, default=1e-5),
        max_position_embeddings=_size(d, "max_position_embeddings", where, default=8192),
        tie_word_embeddings=tie, rope_scaling=_rope_scaling(d, params, where),
        bos_token_id=bos, eos_token_ids=eos)


def _size(d: dict, key: str, where: str, default: int | None = None) -> int:
    """d[key] as a size: a positive JSON integer. Not 2.5, "64" or true, which int() would let through."""
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TinyVLLMError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _positive_number(d: dict, key: str, where: str, default: float | None = None) -> float:
    value = d.get(key, default)
    # the upper bound rejects NaN and Infinity (which Python's json accepts) and ints too big for a float
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= sys.float_info.max:
        raise TinyVLLMError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def is_token_id(value: object) -> bool:
    """A JSON integer >= 0 (JSON's true and false are Python ints too)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_ids(value: object, key: str, where: str) -> tuple[int, ...]:
    """A stop-token field (eos_token_id): one token id, a list of them, or None for none."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(is_token_id(i) for i in ids):
        raise TinyVLLMError(f"{where}: {key} must be a token id (an integer >= 0) or a list of them, "
                            f"got {value!r}")
    return tuple(ids)


def _check_in_vocab(ids: list[int] | tuple[int, ...], vocab_size: int, key: str, where: str) -> None:
    """A stop or start token past the vocabulary can never be sampled or embedded: generation would never stop."""
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise TinyVLLMError(f"{where}: {key} {bad} is past the vocabulary (vocab_size {vocab_size}: ids "
                            f"0..{vocab_size - 1}); fix {key} or re-download the file")


def _head_dim(d: dict, hidden: int, heads: int, where: str) -> int:
    """head_dim, or hidden_size / num_attention_heads where the config leaves it out."""
    if "head_dim" in d:
        head_dim = _size(d, "head_dim", where)
    elif hidden % heads:
        raise TinyVLLMError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                            "set head_dim")
    else:
        head_dim = hidden // heads
    if head_dim % 2:  # RoPE rotates dimension i with dimension i + head_dim/2
        raise TinyVLLMError(f"{where}: head_dim must be even (RoPE rotates pairs of dimensions), got {head_dim}")
    return head_dim


def _rope_parameters(d: dict, where: str) -> dict:
    """transformers >= 5 writes rope_theta and the scaling into one rope_parameters object."""
    params = d.get("rope_parameters", {})
    if not isinstance(params, dict):
        raise TinyVLLMError(f"{where}: rope_parameters must be an object, got {params!r}")
    return params


def _rope_scaling(d: dict, params: dict, where: str) -> dict | None:
    """The llama3 frequency scaling, or None for plain RoPE."""
    key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    scaling = d.get("rope_scaling") or params
    if not isinstance(scaling, dict):
        raise TinyVLLMError(f"{where}: {key} must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):  # plain RoPE: rope_parameters may hold only rope_theta
        return None
    if kind != "llama3":
        raise TinyVLLMError(f"{where}: {key} type {kind!r} is not supported (only 'llama3')")
    for name in ("factor", "low_freq_factor", "high_freq_factor"):  # reference.rope_inv_freq reads them all
        _positive_number(scaling, name, f"{where}: {key}")
    _size(scaling, "original_max_position_embeddings", f"{where}: {key}")
    if scaling["low_freq_factor"] >= scaling["high_freq_factor"]:  # the ramp between them divides by the gap
        raise TinyVLLMError(f"{where}: {key}: low_freq_factor must be below high_freq_factor, got "
                            f"{scaling['low_freq_factor']} and {scaling['high_freq_factor']}")
    return dict(scaling)


def load_config(model_dir: str | Path) -> LlamaConfig:
    """Read `<model_dir>/config.json`, adding the stop tokens of `generation_config.json`."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise TinyVLLMError(f"model directory {model_dir} does not exist; pass --model default or a "
                            "HF-layout directory with config.json and *.safetensors")
    if not path.is_file():
        raise TinyVLLMError(f"{model_dir} has no config.json; pass a HF-layout model directory "
                            "(config.json + *.safetensors)")
    cfg = config_from_dict(read_json_object(path), str(path))
    gen_path = model_dir / "generation_config.json"
    if optional_file(gen_path):  # Llama 3 Instruct lists all three stop ids only here
        gen_eos = read_json_object(gen_path).get("eos_token_id")
        if gen_eos is not None:
            eos = _token_ids(gen_eos, "eos_token_id", str(gen_path))
            _check_in_vocab(eos, cfg.vocab_size, "eos_token_id", str(gen_path))
            cfg = replace(cfg, eos_token_ids=eos)
    return cfg


def write_model_files(out_dir: Path, cfg: LlamaConfig, tokenizer_files: dict[str, dict]) -> None:
    """What load_config reads (config.json, generation_config.json), beside the tokenizer's JSON files."""
    files = {"config.json": cfg.to_hf_dict(), **tokenizer_files,
             "generation_config.json": {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}}
    for name, content in files.items():
        (out_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False))


def optional_file(path: Path) -> bool:
    """Whether an optional model file is there to read. Something else in its place (a directory) is a
    mistake to report, not a missing file to skip: the settings the user put there would be silently lost."""
    if path.is_file():
        return True
    if path.exists():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise TinyVLLMError(f"{path} is {kind}; put the file itself there, or remove it")
    return False


def read_json_object(path: Path) -> dict:
    """A JSON file whose top level is an object, as every HF model file is; else a one-line error."""
    fix = "re-download or re-create the file"
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise TinyVLLMError(f"{path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise TinyVLLMError(f"{path}: not UTF-8 text, so not JSON; {fix}") from None
    if not text.strip():
        raise TinyVLLMError(f"{path}: the file is empty; {fix}")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise TinyVLLMError(f"{path}: not valid JSON ({e}); {fix}") from None
    except RecursionError:  # Python's parser recurses once per [ or {: thousands deep exhaust the stack
        raise TinyVLLMError(f"{path}: JSON nested too deeply to be a model file; {fix}") from None
    if not isinstance(d, dict):
        raise TinyVLLMError(f"{path}: must hold a JSON object {{...}}, got a {type(d).__name__}; {fix}")
    return d


def expected_tensor_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a HF Llama checkpoint and its (out, in) shape: the contract a checkpoint must meet."""
    h, shapes = cfg.hidden_size, {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (cfg.q_size, h),
            p + "self_attn.k_proj.weight": (cfg.kv_size, h),
            p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        })
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """The rotation speed of each of the head_dim/2 frequency pairs, with llama3 scaling if configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    # llama3: slow (long-wavelength) frequencies are divided by `factor`, fast ones kept, a smooth ramp between
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / s["low_freq_factor"], old_len / s["high_freq_factor"]
    wavelen = 2 * np.pi / inv_freq
    smooth = (old_len / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    ramp = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    scaled = np.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), ramp, scaled)
    return scaled.astype(np.float32)
