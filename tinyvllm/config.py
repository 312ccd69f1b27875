"""Chapter 1: the handful of numbers that define a Llama model, read from its `config.json`.

Every shape in the engine is derived from this one object, so a checkpoint of another size
(SmolLM2-135M, Llama 3.2 1B/3B, Llama 3.1 8B) needs no code change.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

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

    def to_hf_dict(self) -> dict:
        """The config.json that transformers' LlamaForCausalLM reads."""
        d = asdict(self)
        eos = list(d.pop("eos_token_ids"))
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
                 hidden_act="silu", attention_bias=False, mlp_bias=False,
                 eos_token_id=eos[0] if len(eos) == 1 else eos)
        return d


def config_from_dict(d: dict, where: str = "config.json") -> LlamaConfig:
    """Validate a HF config dict and keep the fields the engine uses."""
    arch = (d.get("architectures") or [d.get("model_type", "?")])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise TinyVLLMError(f"{where}: architecture {arch!r} is not supported; tinyvllm runs "
                            f"{', '.join(SUPPORTED_ARCHITECTURES)} checkpoints (Llama 3.x, SmolLM2)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in d]
    if missing:
        raise TinyVLLMError(f"{where}: missing {', '.join(missing)}; is this a HF Llama config.json?")
    heads = int(d["num_attention_heads"])
    kv_heads = int(d.get("num_key_value_heads") or heads)
    head_dim = int(d.get("head_dim") or d["hidden_size"] // heads)
    if heads % kv_heads:
        raise TinyVLLMError(f"{where}: num_attention_heads={heads} is not a multiple of "
                            f"num_key_value_heads={kv_heads}")
    scaling = d.get("rope_scaling") or d.get("rope_parameters")  # transformers >= 5 writes rope_parameters
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):  # plain RoPE: rope_parameters may hold only rope_theta
            scaling = None
        elif kind != "llama3":
            raise TinyVLLMError(f"{where}: rope_scaling type {kind!r} is not supported (only 'llama3')")
    rope_theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    eos = d.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return LlamaConfig(
        vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rope_theta=float(rope_theta), rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        rope_scaling=dict(scaling) if scaling else None,
        bos_token_id=d.get("bos_token_id"), eos_token_ids=eos)


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
    d = _read_json(path)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():  # Llama 3 Instruct lists all three stop ids only here
        gen_eos = _read_json(gen_path).get("eos_token_id")
        if gen_eos is not None:
            d = {**d, "eos_token_id": gen_eos}
    return config_from_dict(d, str(path))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TinyVLLMError(f"{path}: not valid JSON ({e}); re-download or re-create the file") from None


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
