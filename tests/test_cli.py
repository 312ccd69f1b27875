"""`python -m tinyvllm ...` as a user runs it: answers, streaming, synthetic checkpoints, and one-line errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from tests.numeric import rel_err
from tinyvllm.formats.checkpoints import PRESETS
from tinyvllm.formats.config import expected_tensor_shapes, load_config
from tinyvllm.model.weights import load_weights
from tinyvllm.reference import ReferenceModel

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
        "--intermediate", "128"]


def tinyvllm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "tinyvllm", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    if check:
        assert run.returncode == 0, f"exit {run.returncode}\n{run.stderr[-3000:]}"
    return run


def synth(out: Path, seed: int = 3, like: str = "llama-3.2-1b") -> Path:
    tinyvllm("synth", "--like", like, *TINY, "--out", str(out), "--seed", str(seed))
    return out


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("synth") / "a")


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def copy_of(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "copy"))


# ---------------------------------------------------------------- generate

@pytest.fixture(scope="module")
def json_answer(default_model_dir) -> dict:
    run = tinyvllm("generate", QUESTION, "--json", "--max-tokens", "32", "--device", "cpu")
    return json.loads(run.stdout)


def test_generate_json(json_answer, default_model_dir):
    from tinyvllm.formats.tokenizer import load_tokenizer
    special = load_tokenizer(default_model_dir).special_tokens  # the ids come from the model's tokenizer
    assert set(json_answer) == {"text", "token_ids", "prompt_token_ids", "finish_reason", "timings"}
    assert "Paris" in json_answer["text"]
    assert json_answer["finish_reason"] == "stop" and json_answer["token_ids"][-1] == special["<|im_end|>"]
    assert json_answer["prompt_token_ids"][0] == special["<|im_start|>"]  # the chat template starts with it
    assert {"time_to_first_token_s", "time_per_output_token_s", "decode_tokens_per_s"} <= set(json_answer["timings"])


def test_generate_streams_text_to_stdout_and_stats_to_stderr(json_answer):
    run = tinyvllm("generate", QUESTION, "--max-tokens", "32")
    assert run.stdout.startswith(json_answer["text"])  # the same greedy answer, then the stats' blank line
    assert run.stdout.strip() == json_answer["text"].strip()
    stats = run.stderr.strip().splitlines()[-1]
    assert f"{len(json_answer['prompt_token_ids'])} prompt tokens" in stats
    assert f"{len(json_answer['token_ids'])} generated" in stats and "tokens/s" in stats


def test_generate_raw_skips_the_chat_template(default_model_dir):
    from tinyvllm.formats.tokenizer import load_tokenizer
    run = tinyvllm("generate", "The capital of France is", "--raw", "--json", "--max-tokens", "4")
    out = json.loads(run.stdout)
    assert out["prompt_token_ids"] == load_tokenizer(default_model_dir).encode("The capital of France is")
    assert "Paris" in out["text"] and out["finish_reason"] == "length" and len(out["token_ids"]) == 4


def test_model_path_default(default_model_dir):
    path = Path(tinyvllm("model-path", "default").stdout.strip())
    assert path.is_dir() and (path / "config.json").is_file() and path == default_model_dir


# ---------------------------------------------------------------- synth

def test_synth_is_deterministic_per_seed(synth_dir, tmp_path):
    again, other = synth(tmp_path / "again"), synth(tmp_path / "other", seed=4)
    files = sorted(p.name for p in synth_dir.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (synth_dir / name).read_bytes() == (again / name).read_bytes(), name
    assert (synth_dir / "config.json").read_bytes() == (other / "config.json").read_bytes()
    with safe_open(str(synth_dir / "model.safetensors"), "pt") as a, \
            safe_open(str(other / "model.safetensors"), "pt") as b:
        for name in a.keys():
            if a.get_tensor(name).ndim == 2:  # every matrix differs (norm weights are near 1 either way)
                assert not torch.equal(a.get_tensor(name), b.get_tensor(name)), name


def test_synth_loads_in_transformers_with_the_preset_config(synth_dir):
    model, info = LlamaForCausalLM.from_pretrained(str(synth_dir), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    preset = PRESETS["llama-3.2-1b"]
    hf = model.config
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
            hf.intermediate_size) == (2, 64, 4, 2, 16, 128)
    assert (hf.vocab_size, hf.tie_word_embeddings, hf.max_position_embeddings) == \
        (preset.vocab_size, preset.tie_word_embeddings, preset.max_position_embeddings)
    assert hf.rope_parameters == {**preset.rope_scaling, "rope_theta": preset.rope_theta}
    with safe_open(str(synth_dir / "model.safetensors"), "pt") as f:
        stored = {name: tuple(f.get_tensor(name).shape) for name in f.keys()}
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}
    hf_params = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied lm_head listed once
    assert stored == hf_params == expected_tensor_shapes(load_config(synth_dir))
    # and the engine reads it the same way transformers does
    cfg = load_config(synth_dir)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 40).tolist()
    ours = ReferenceModel(cfg, load_weights(synth_dir, cfg).views).forward(ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    assert rel_err(ours, theirs) < 1e-4


@pytest.mark.parametrize("preset", list(PRESETS))
def test_full_size_preset_names_and_shapes_match_transformers(preset):
    config = PRESETS[preset].to_hf_dict()
    with torch.device("meta"):  # shapes only: no 1B-parameter allocation
        model = LlamaForCausalLM(HFLlamaConfig(**config))
    hf_params = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert hf_params == expected_tensor_shapes(PRESETS[preset])
    scaled = PRESETS[preset].rope_scaling is not None
    assert model.config.rope_parameters["rope_type"] == ("llama3" if scaled else "default")


# ---------------------------------------------------------------- user mistakes: exit 2, one line, no traceback

def assert_user_error(run: subprocess.CompletedProcess, *words: str) -> None:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, f"exit {run.returncode}: {run.stderr[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr[-2000:]
    assert "Traceback" not in run.stderr and run.stdout == ""
    for word in words:
        assert word in lines[0], lines[0]


def test_missing_model_path(tmp_path):
    assert_user_error(tinyvllm("generate", "hi", "--model", str(tmp_path / "nope"), check=False), "does not exist")


def test_directory_without_config(tmp_path):
    assert_user_error(tinyvllm("generate", "hi", "--model", str(tmp_path), check=False), "config.json")


@pytest.mark.parametrize("config", [
    {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
    {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4},
])
def test_unsupported_architecture(synth_dir, tmp_path, config):
    model = copy_of(synth_dir, tmp_path)
    (model / "config.json").write_text(json.dumps(config))
    assert_user_error(tinyvllm("generate", "hi", "--model", str(model), check=False),
                      config["architectures"][0], "not supported")


@pytest.mark.parametrize("damage", ["truncated", "garbage header", "empty"])
def test_corrupt_safetensors(synth_dir, tmp_path, damage):
    model = copy_of(synth_dir, tmp_path)
    path = model / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:len(data) // 2], "garbage header": data[:8] + b"\xff" * 64 + data[72:],
                      "empty": b""}[damage])
    assert_user_error(tinyvllm("generate", "hi", "--model", str(model), check=False), "model.safetensors")


def test_prompt_longer_than_the_context_window(synth_dir, tmp_path):
    model = copy_of(synth_dir, tmp_path)
    edit_config(model, max_position_embeddings=16)
    assert_user_error(tinyvllm("generate", "hello " * 20, "--raw", "--model", str(model), check=False),
                      "context window is 16")


@pytest.mark.parametrize("flags, words", [
    (["--max-tokens", "0"], ["--max-tokens"]),
    (["--max-tokens", "many"], ["--max-tokens"]),
    (["--temperature", "-1"], ["temperature"]),
    (["--top-p", "2"], ["top_p"]),
    (["--top-k", "-5"], ["top_k"]),
    (["--device", "tpu"], ["--device", "tpu"]),
    (["--model"], ["--model"]),
])
def test_invalid_flag_values(flags, words):
    assert_user_error(tinyvllm("generate", "hi", *flags, check=False), *words)


@pytest.mark.parametrize("args, words", [
    (["serve-forever"], ["serve-forever", "(see python -m tinyvllm --help)"]),
    ([], ["command"]),
    (["generate"], ["prompt", "(see python -m tinyvllm generate --help)"]),
    (["synth", "--out", "x", "--layers", "0"], ["--layers"]),
    (["synth", "--like", "gpt-5", "--out", "x"], ["gpt-5", "llama-3.2-1b"]),
])
def test_bad_commands(args, words):
    assert_user_error(tinyvllm(*args, check=False), *words)


def test_synth_refuses_a_non_empty_directory(synth_dir):
    assert_user_error(tinyvllm("synth", *TINY, "--out", str(synth_dir), check=False), "not empty")


@pytest.mark.parametrize("out, words", [
    ("missing/parent/model", ["missing/parent does not exist"]),
    ("a-file", ["a-file is a file, not a directory"]),
    ("a-file/model", ["a-file is not a directory"]),
])
def test_synth_refuses_an_out_it_cannot_create_and_writes_nothing(tmp_path, out, words):
    (tmp_path / "a-file").write_text("kept")
    before = sorted(tmp_path.rglob("*"))
    assert_user_error(tinyvllm("synth", *TINY, "--out", str(tmp_path / out), check=False), "--out", *words)
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "a-file").read_text() == "kept"


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_a_json_file_nested_100000_deep_in_a_real_process(synth_dir, tmp_path, name):
    """The JSON parser's recursion limit, hit in a fresh interpreter with its default stack."""
    model = copy_of(synth_dir, tmp_path)
    (model / name).write_text("[" * 100_000 + "]" * 100_000)
    assert_user_error(tinyvllm("info", "--model", str(model), check=False), name, "nested too deeply")


@pytest.mark.parametrize("index", ['{"weight_map": [1, 2]}', '{"weight_map": {"a": 3}}', '{}'])
def test_a_safetensors_index_without_a_weight_map_is_one_line(synth_dir, tmp_path, index):
    model = copy_of(synth_dir, tmp_path)
    (model / "model.safetensors.index.json").write_text(index)
    assert_user_error(tinyvllm("info", "--model", str(model), check=False), "model.safetensors.index.json",
                      "weight_map")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path, where):
    args = ["generate", "hi", "--model", str(tmp_path / "nope")]
    run = tinyvllm(*(["--debug", *args] if where == "before" else [*args, "--debug"]), check=False)
    assert run.returncode != 0
    assert "Traceback" in run.stderr and "TinyVLLMError: model path" in run.stderr


def test_generate_several_prompts_and_a_file_in_input_order(tmp_path, default_model_dir):
    """Three prompts (two from a file, blank lines skipped) batched together: each answer is what the
    same prompt gets alone."""
    prompts = ["What is 2+2?", "Name a color.", "Say hello."]
    (tmp_path / "p.txt").write_text(f"{prompts[1]}\n\n{prompts[2]}\n")
    run = tinyvllm("generate", prompts[0], "--file", str(tmp_path / "p.txt"), "--json", "--max-tokens", "10",
                   "--device", "cpu")
    together = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(together) == 3
    for prompt, out in zip(prompts, together):
        alone = json.loads(tinyvllm("generate", prompt, "--json", "--max-tokens", "10", "--device", "cpu").stdout)
        assert out["token_ids"] == alone["token_ids"] and out["text"] == alone["text"], prompt


def test_generate_without_a_prompt_or_with_a_missing_file_is_one_line(tmp_path):
    for args, message in [((), "give a prompt"), (("--file", str(tmp_path / "nope.txt")), "cannot read --file")]:
        run = tinyvllm("generate", *args, check=False)
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_every_engine_setting_is_a_flag_of_every_engine_command(command):
    """The engine flags are made from EngineConfig's fields: a new setting cannot be forgotten by the CLI."""
    from tinyvllm.engine.engine_config import EngineConfig
    from tinyvllm.entrypoints.cli import build_parser, engine_config
    flags = ["--enforce-eager", "--no-enable-prefix-caching", "--max-num-seqs", "7", "--device", "cpu"]
    args = build_parser().parse_args([command, *flags] + (["hi"] if command == "generate" else []))
    config = engine_config(args)
    assert (config.enforce_eager, config.enable_prefix_caching, config.max_num_seqs, config.device) == \
        (True, False, 7, "cpu")
    assert {n: getattr(config, n) for n in EngineConfig.names() if n not in ("enforce_eager", "enable_prefix_caching",
            "max_num_seqs", "device")} == {n: getattr(EngineConfig(), n) for n in EngineConfig.names()
                                           if n not in ("enforce_eager", "enable_prefix_caching", "max_num_seqs",
                                                        "device")}, "a flag's default differs from EngineConfig's"


def test_llm_refuses_a_setting_it_does_not_have_in_one_line():
    from tinyvllm import LLM
    from tinyvllm.errors import TinyVLLMError
    with pytest.raises(TinyVLLMError, match=r"unknown settings \['max_num_seq'\]"):
        LLM("default", max_num_seq=4)
