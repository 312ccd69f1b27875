"""Chapter 1: a llama GGUF file -> a HF-layout model directory, the file read once.

A GGUF holds a whole model in one file: quantized tensors, and metadata fields that carry the config
(llama.*) and the tokenizer (tokenizer.*). One GGUFReader parse feeds the three: the tensors become bf16
model.safetensors, the fields become config.json, tokenizer.json and tokenizer_config.json.
"""
from __future__ import annotations

import copy
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.bf16 import float32_to_bf16_bits
from tinyvllm.formats.config import LlamaConfig, expected_tensor_shapes, write_model_files
from tinyvllm.formats.safetensors_format import write_safetensors
from tinyvllm.formats.tokenizer import LLAMA3_PATTERN

# GGUF tensor names -> HF names (per layer and global)
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}

# tokenizer.ggml.pre names llama.cpp gives these pre-tokenizers, as HF tokenizer.json pre_tokenizers.
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_GGUF_PRE_TOKENIZERS = {
    "gpt-2": _BYTE_LEVEL,
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "llama-bpe": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {**_BYTE_LEVEL, "use_regex": False}]},
}


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a llama-architecture GGUF into a HF-layout directory with bf16 safetensors."""
    import gguf  # only needed for this one conversion

    reader = gguf.GGUFReader(str(gguf_path))
    meta = _metadata(reader)  # read once: the config and the tokenizer are both built from it
    cfg = _config_from_gguf(meta, has_lm_head=any(t.name == "output.weight" for t in reader.tensors))
    tensors = {}
    for t in tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor"):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rope_rows(w, cfg.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rope_rows(w, cfg.num_key_value_heads)
        tensors[hf_name(t.name)] = ("BF16", float32_to_bf16_bits(w))
    expected = expected_tensor_shapes(cfg)
    assert {n: a.shape for n, (_, a) in tensors.items()} == expected, "GGUF tensors do not match its config"
    write_safetensors(out_dir / "model.safetensors", {n: tensors[n] for n in expected}, {"format": "pt"})
    write_model_files(out_dir, cfg, _tokenizer_files(meta, gguf_path))


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Q/K rows interleaved (x0,y0,x1,y1..) per head; HF wants halves (x0,x1..,y0,y1..)."""
    out, inp = w.shape
    return w.reshape(heads, out // heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _metadata(reader) -> dict:
    """Every metadata field's value (a gguf.GGUFReader's), by its key."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _config_from_gguf(meta: dict, has_lm_head: bool) -> LlamaConfig:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise TinyVLLMError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return LlamaConfig(
        vocab_size=int(meta["llama.vocab_size"]), hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]), num_attention_heads=heads,
        num_key_value_heads=int(meta["llama.attention.head_count_kv"]),
        head_dim=int(meta.get("llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(meta["llama.rope.freq_base"]),
        rms_norm_eps=round(float(meta["llama.attention.layer_norm_rms_epsilon"]), 9),  # f32 1e-5 -> 1e-5
        max_position_embeddings=int(meta["llama.context_length"]), tie_word_embeddings=not has_lm_head,
        bos_token_id=1, eos_token_ids=(2,))


def tokenizer_files_from_gguf(gguf_path: str | os.PathLike) -> dict[str, dict]:
    """The HF tokenizer files of a GGUF, its tensors left unread (for load_tokenizer on a .gguf, and synth)."""
    try:
        path = Path(gguf_path).resolve()
        meta = _cached_metadata(path, path.stat().st_mtime_ns)
    except (OSError, ValueError) as e:
        raise TinyVLLMError(f"cannot read GGUF file {gguf_path} ({e}); check the path and re-download it") from None
    return _tokenizer_files(meta, gguf_path)


@lru_cache(maxsize=2)
def _cached_metadata(path: Path, mtime_ns: int) -> dict:
    """A GGUF's metadata; cached by path and mtime, as its string arrays take seconds to parse."""
    import gguf  # only GGUF files need it (the default model's conversion)

    return _metadata(gguf.GGUFReader(path))


def _tokenizer_files(meta: dict, gguf_path: str | os.PathLike) -> dict[str, dict]:
    """Rebuild the HF tokenizer.json and tokenizer_config.json a byte-level BPE GGUF was made from."""
    field = meta.get
    pre = field("tokenizer.ggml.pre", "gpt-2")
    if field("tokenizer.ggml.model") != "gpt2" or pre not in _GGUF_PRE_TOKENIZERS:
        raise TinyVLLMError(f"{gguf_path} has a tokenizer tinyvllm does not support (model "
                            f"{field('tokenizer.ggml.model')!r}, pre {pre!r}); use a Llama 3 or SmolLM2 GGUF")
    tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type")
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == 3}  # 3: control token, 4: user-defined
             for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (3, 4)]
    hf_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": copy.deepcopy(_GGUF_PRE_TOKENIZERS[pre]),
        "post_processor": {**_BYTE_LEVEL, "trim_offsets": False},
        "decoder": dict(_BYTE_LEVEL),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre == "llama-bpe",  # as Meta's tiktoken: a piece in the vocab is one token
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ") for m in field("tokenizer.ggml.merges", [])]},
    }
    arch = field("general.architecture", "llama")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": int(field(f"{arch}.context_length", 8192))}
    for role in ("bos", "eos", "pad", "unk"):
        token_id = field(f"tokenizer.ggml.{role}_token_id")
        if token_id is not None:
            config[f"{role}_token"] = tokens[token_id]
    if field("tokenizer.chat_template"):
        config["chat_template"] = field("tokenizer.chat_template")
    return {"tokenizer.json": hf_json, "tokenizer_config.json": config}
