"""Malformed model files are a user's mistake: one line naming the file and the field, exit code 2, no traceback.

Each case damages one file of a valid tiny checkpoint (the other files are symlinks to it) and runs the CLI
in-process, so the whole module takes a few seconds.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tinyvllm.entrypoints.cli import main
from tinyvllm.entrypoints.llm import LLM
from tinyvllm.formats.checkpoints import llama3_tokenizer_dir
from tinyvllm.formats.config import config_from_dict, load_config
from tinyvllm.formats.tokenizer import load_tokenizer
from tinyvllm.model.kv_pool import bytes_per_block

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def base(tiny_llama_dir) -> Path:
    return tiny_llama_dir  # read only: model_with() copies it before damaging a file


def original(base: Path, name: str) -> Path:
    """The valid file a case damages: the checkpoint's own, or Llama 3's tiktoken file (it ships none)."""
    return base / name if (base / name).exists() else llama3_tokenizer_dir() / name


def model_with(base: Path, folder: Path, name: str, content: bytes) -> Path:
    """A model directory with `base`'s files, except `name`, which holds `content`."""
    folder.mkdir()
    for f in base.iterdir():
        if f.name != name:
            (folder / f.name).symlink_to(f)
    (folder / name).write_bytes(content)
    return folder


# ---------------------------------------------------------------- ways to damage a file

Damage = Callable[[Path], bytes]  # the valid file -> the damaged file's bytes


def raw(data: bytes) -> Damage:
    return lambda valid: data


def fields(**changes) -> Damage:
    """The JSON file with some top-level fields changed."""
    return lambda valid: json.dumps({**json.loads(valid.read_bytes()), **changes}).encode()


def nested(edit: Callable[[dict], object]) -> Damage:
    """The JSON file after `edit` changed it in place."""
    def damage(valid: Path) -> bytes:
        d = json.loads(valid.read_bytes())
        edit(d)
        return json.dumps(d).encode()
    return damage


def tiktoken_line(line: bytes) -> Damage:
    """tokenizer.model with its 1000th 'base64-token rank' line replaced."""
    def damage(valid: Path) -> bytes:
        lines = valid.read_bytes().splitlines()
        lines[999] = line
        return b"\n".join(lines) + b"\n"
    return damage


def special_id(name: str, new_id: int) -> Damage:
    """tokenizer.json with the added token `name` moved to `new_id`."""
    return nested(lambda d: next(t for t in d["added_tokens"] if t["content"] == name).update(id=new_id))


def deep_safetensors_header(valid: Path) -> bytes:
    """A safetensors file whose header, of the right length, is a list 100,000 levels deep."""
    header = b"[" * 100_000 + b"]" * 100_000
    return struct.pack("<Q", len(header)) + header


def case(name: str, damage: Damage, *words: str, id: str):
    return pytest.param(name, damage, words, id=id)


CONFIG = "config.json"
GEN = "generation_config.json"
TOK = "tokenizer.json"
TOK_CONFIG = "tokenizer_config.json"
CASES = [
    case(CONFIG, raw(b"[]"), CONFIG, "object", id="config-top-level-list"),
    case(CONFIG, raw(b""), CONFIG, "empty", id="config-empty"),
    case(CONFIG, raw(b"\xff\xfe{}"), CONFIG, "UTF-8", id="config-not-utf8"),
    case(CONFIG, raw(b'{"vocab_size": 1'), CONFIG, "not valid JSON", id="config-not-json"),
    case(CONFIG, fields(architectures="LlamaForCausalLM"), CONFIG, "architectures", id="architectures-string"),
    case(CONFIG, fields(vocab_size="lots"), CONFIG, "vocab_size", "'lots'", id="vocab-string"),
    case(CONFIG, fields(hidden_size=2.5), "hidden_size", "2.5", id="hidden-float"),
    case(CONFIG, fields(intermediate_size=True), "intermediate_size", id="intermediate-bool"),
    case(CONFIG, fields(num_hidden_layers=-2), "num_hidden_layers", id="layers-negative"),
    case(CONFIG, fields(vocab_size=0), "vocab_size", id="vocab-zero"),
    case(CONFIG, fields(num_attention_heads=0, head_dim=None), "num_attention_heads", id="heads-zero"),
    case(CONFIG, fields(num_attention_heads=5, num_key_value_heads=1, head_dim=None), "hidden_size",
         "num_attention_heads", id="hidden-not-divisible-by-heads"),
    case(CONFIG, fields(num_key_value_heads=3), "num_key_value_heads", id="kv-heads-not-dividing"),
    case(CONFIG, fields(num_key_value_heads=0), "num_key_value_heads", id="kv-heads-zero"),
    case(CONFIG, fields(head_dim=15), "head_dim", "even", id="head-dim-odd"),
    case(CONFIG, fields(rope_theta="fast"), "rope_theta", id="rope-theta-string"),
    case(CONFIG, fields(rms_norm_eps=-1e-5), "rms_norm_eps", id="eps-negative"),
    case(CONFIG, fields(max_position_embeddings=0), "max_position_embeddings", id="context-zero"),
    case(CONFIG, fields(tie_word_embeddings="false"), "tie_word_embeddings", id="tie-string"),
    case(CONFIG, fields(bos_token_id="one"), "bos_token_id", id="bos-string"),
    case(CONFIG, fields(eos_token_id="two"), CONFIG, "eos_token_id", id="eos-string"),
    case(CONFIG, fields(rope_scaling="yes"), "rope_scaling", "object", id="rope-scaling-string"),
    case(CONFIG, fields(rope_scaling=None, rope_parameters=[1]), "rope_parameters", id="rope-parameters-list"),
    case(CONFIG, fields(rope_scaling={**LLAMA3_ROPE, "factor": None}), "rope_scaling", "factor",
         id="llama3-factor-missing"),
    case(CONFIG, fields(rope_scaling={**LLAMA3_ROPE, "low_freq_factor": "one"}), "low_freq_factor",
         id="llama3-low-freq-string"),
    case(CONFIG, fields(rope_scaling={**LLAMA3_ROPE, "original_max_position_embeddings": 8192.5}),
         "original_max_position_embeddings", id="llama3-original-context-float"),
    case(CONFIG, fields(rope_scaling={**LLAMA3_ROPE, "high_freq_factor": 1.0}), "high_freq_factor",
         id="llama3-equal-freq-factors"),
    case(CONFIG, raw(b"[" * 100_000 + b"]" * 100_000), CONFIG, "nested too deeply", id="config-100000-deep"),
    case(CONFIG, fields(hidden_size=2**40), "model.safetensors", "config.json implies", id="hidden-absurd"),
    case(CONFIG, fields(max_position_embeddings=10**15), "RoPE tables", "PiB", "host memory", "--max-model-len",
         id="context-absurd"),
    case(CONFIG, fields(eos_token_id=10**6), CONFIG, "eos_token_id 1000000", "past the vocabulary",
         id="eos-past-vocab"),
    case(CONFIG, fields(bos_token_id=128256), CONFIG, "bos_token_id 128256", "past the vocabulary",
         id="bos-past-vocab"),
    case(GEN, raw(b"[]"), GEN, "object", id="generation-config-top-level-list"),
    case(GEN, raw(b"{"), GEN, "not valid JSON", id="generation-config-not-json"),
    case(GEN, fields(eos_token_id="two"), GEN, "eos_token_id", "'two'", id="generation-eos-string"),
    case(GEN, fields(eos_token_id=[128001, None]), GEN, "eos_token_id", id="generation-eos-list-with-null"),
    case(GEN, fields(eos_token_id=-1), GEN, "eos_token_id", id="generation-eos-negative"),
    case(GEN, fields(eos_token_id=[128001, 128256]), GEN, "eos_token_id 128256", "past the vocabulary",
         id="generation-eos-past-vocab"),
    case(TOK, raw(b"[1, 2]"), TOK, "object", id="tokenizer-top-level-list"),
    case(TOK, raw(b""), TOK, "empty", id="tokenizer-empty"),
    case(TOK, nested(lambda d: d.pop("model")), TOK, "model", id="tokenizer-no-model"),
    case(TOK, nested(lambda d: d.update(model=[])), TOK, "model", id="tokenizer-model-list"),
    case(TOK, nested(lambda d: d["model"].pop("vocab")), TOK, "model.vocab", id="tokenizer-no-vocab"),
    case(TOK, nested(lambda d: d["model"].update(vocab=[])), TOK, "model.vocab", id="tokenizer-vocab-list"),
    case(TOK, nested(lambda d: d["model"]["vocab"].update(hello="x")), TOK, "vocab", "hello",
         id="tokenizer-vocab-id-string"),
    case(TOK, nested(lambda d: d["model"]["vocab"].update(hello=0)), TOK, "vocab", "hello",
         id="tokenizer-vocab-duplicate-id"),
    case(TOK, nested(lambda d: d.update(added_tokens={})), TOK, "added_tokens", id="added-tokens-object"),
    case(TOK, nested(lambda d: d["added_tokens"][0].pop("content")), TOK, "added_tokens",
         id="added-token-without-content"),
    case(TOK, nested(lambda d: d.update(pre_tokenizer="ByteLevel")), TOK, "pre_tokenizer",
         id="pre-tokenizer-string"),
    case(TOK, nested(lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(pattern="x")), TOK,
         "pre_tokenizer", id="pre-tokenizer-pattern-string"),
    case(TOK, special_id("<|eot_id|>", 10**6), TOK, "'<|eot_id|>'", "1000000", "past the model's vocabulary",
         id="template-special-token-past-vocab"),
    case(TOK, special_id("<|begin_of_text|>", 200_000), TOK, "'<|begin_of_text|>'", "past the model's vocabulary",
         id="bos-special-token-past-vocab"),
    case(TOK, special_id("<|image|>", 2**32), TOK, "added_tokens", "2**32", id="special-token-id-past-32-bits"),
    case(TOK, nested(lambda d: d["model"].update(merges="Ġ t")), TOK, "model.merges", id="merges-string"),
    case(TOK, nested(lambda d: d["model"]["merges"].insert(5, "garbage")), TOK, "model.merges[5]", "'garbage'",
         id="merge-garbage"),
    case(TOK, nested(lambda d: d["model"]["merges"].append("Ġ qqqqqqqq")), TOK, "model.merges[280147]",
         "'qqqqqqqq'", "not in model.vocab", id="merge-of-unknown-token"),
    case(TOK_CONFIG, raw(b"[]"), TOK_CONFIG, "object", id="tokenizer-config-top-level-list"),
    case(TOK_CONFIG, fields(bos_token=["<s>"]), TOK_CONFIG, "bos_token", id="bos-token-list"),
    case(TOK_CONFIG, fields(chat_template=5), TOK_CONFIG, "chat_template", id="chat-template-number"),
    case(TOK_CONFIG, fields(chat_template=[{"name": "default"}]), TOK_CONFIG, "chat_template",
         id="named-chat-template-without-text"),
    case(TOK_CONFIG, fields(chat_template="{% if %}"), "chat template", id="chat-template-syntax-error"),
    case(TOK_CONFIG, fields(chat_template="{% for i in range(10**9) %}x{% endfor %}"), "chat template failed",
         "OverflowError", "MAX_RANGE", id="chat-template-range-past-the-sandbox"),
    case("chat_template.jinja", raw(b"\xff{{ bos_token }}"), "chat_template.jinja", "UTF-8",
         id="chat-template-file-not-utf8"),
    case("tokenizer.model", tiktoken_line(b"IQ=="), "tokenizer.model", "line 1000", id="tiktoken-line-no-rank"),
    case("tokenizer.model", tiktoken_line(b"not-base64! 999"), "tokenizer.model", "line 1000",
         id="tiktoken-line-bad-base64"),
    case("tokenizer.model", tiktoken_line(b"IQ== -5"), "tokenizer.model", "line 1000",
         id="tiktoken-line-negative-rank"),
    case("tokenizer.model", tiktoken_line(b"IQ== 5"), "tokenizer.model", "line 1000",
         id="tiktoken-line-duplicate-rank"),
    case("model.safetensors", deep_safetensors_header, "model.safetensors", "nested too deeply",
         id="safetensors-header-100000-deep"),
]


def run_cli(capsys, *args: str) -> tuple[int, list[str]]:
    code = main(list(args))
    return code, capsys.readouterr().err.strip().splitlines()


def assert_one_line(code: int, lines: list[str], *words: str, folder: Path | None = None) -> None:
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    message = lines[0].replace(f"{folder}{os.sep}", "")  # so that no word is found in the folder's name
    for word in words:
        assert word in message, message


def generate(model: Path, capsys) -> tuple[int, list[str]]:
    """`generate` reads config.json, generation_config.json and the tokenizer files before the weights."""
    return run_cli(capsys, "generate", "hi", "--max-tokens", "1", "--device", "cpu", "--model", str(model))


@pytest.mark.parametrize("name, damage, words", CASES)
def test_malformed_file_is_one_line_and_exit_2(base, tmp_path, capsys, name, damage, words):
    model = model_with(base, tmp_path / "model", name, damage(original(base, name)))
    assert_one_line(*generate(model, capsys), *words, folder=model)


@pytest.mark.parametrize("name", [GEN, TOK_CONFIG, "chat_template.jinja"])
def test_a_directory_in_place_of_a_model_file(base, tmp_path, capsys, name):
    """An optional file that is a directory is reported, not skipped: its settings would be silently lost."""
    model = model_with(base, tmp_path / "model", name, b"")
    (model / name).unlink()
    (model / name).mkdir()
    assert_one_line(*generate(model, capsys), name, "is a directory", folder=model)


def test_a_special_token_no_prompt_uses_may_lie_past_the_vocabulary(base):
    """Llama 3.2's tokenizer.json lists the vision model's <|image|> at 128256, one past the text model's
    vocabulary: refusing it on loading would refuse Meta's own files. Only a token a prompt uses is checked."""
    tokenizer = load_tokenizer(base)
    assert tokenizer.special_tokens["<|image|>"] == load_config(base).vocab_size
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_the_undamaged_copy_runs(base, tmp_path, capsys):
    """The control: the symlinked copy, with the file of one case rewritten unchanged, is a working model."""
    model = model_with(base, tmp_path / "model", CONFIG, original(base, CONFIG).read_bytes())
    code, lines = generate(model, capsys)
    assert code == 0 and "finish: length" in lines[-1], lines


def test_a_real_process_exits_2_without_a_traceback(base, tmp_path):
    model = model_with(base, tmp_path / "model", CONFIG, fields(vocab_size="lots")(original(base, CONFIG)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "tinyvllm", "info", "--model", str(model)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.splitlines() == [f"error: {model / CONFIG}: vocab_size must be a positive integer, got 'lots'"]


# ---------------------------------------------------------------- which directory --model names

def test_default_model_override_set_to_default_is_a_path(monkeypatch, capsys):
    monkeypatch.setenv("TINYVLLM_DEFAULT_MODEL", "default")  # once resolved by name again, forever
    assert_one_line(*run_cli(capsys, "model-path"), "$TINYVLLM_DEFAULT_MODEL", "does not exist", "unset it")


def test_home_of_an_unknown_user(capsys):
    assert_one_line(*run_cli(capsys, "info", "--model", "~no-such-user-here/model"), "~no-such-user-here", "'~'")


def test_default_model_folder_without_its_weights(tmp_path, monkeypatch, capsys):
    """A converted default model whose model.safetensors was deleted: say so, do not convert for nothing."""
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path))
    monkeypatch.delenv("TINYVLLM_DEFAULT_MODEL", raising=False)
    monkeypatch.setattr("tinyvllm.formats.gguf_convert.convert_gguf", lambda gguf, out: (out / "model.safetensors").write_bytes(b""))
    final = tmp_path / "models" / "SmolLM2-135M-Instruct"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    assert_one_line(*run_cli(capsys, "model-path"), str(final), "model.safetensors", "delete")


# ---------------------------------------------------------------- valid variants keep loading

VALID = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4}
OLD_ROPE = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}  # older configs name it "type"


@pytest.mark.parametrize("extra, expected", [
    ({}, dict(num_key_value_heads=4, head_dim=16, rope_scaling=None, eos_token_ids=())),
    ({"num_key_value_heads": None, "head_dim": None, "rope_scaling": None, "eos_token_id": 2},
     dict(num_key_value_heads=4, head_dim=16, eos_token_ids=(2,))),
    ({"rope_theta": 500000, "rms_norm_eps": 1e-6, "bos_token_id": None},
     dict(rope_theta=500000.0, rms_norm_eps=1e-6)),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
     dict(rope_theta=100000.0, rope_scaling=None)),
    ({"rope_scaling": LLAMA3_ROPE, "eos_token_id": [1, 2]}, dict(rope_scaling=LLAMA3_ROPE, eos_token_ids=(1, 2))),
    ({"rope_scaling": {**OLD_ROPE, "type": "llama3"}}, dict(rope_scaling={**OLD_ROPE, "type": "llama3"})),
])
def test_valid_configs_still_load(extra, expected):
    cfg = config_from_dict({**VALID, **extra})
    assert {k: getattr(cfg, k) for k in expected} == expected


# ---------------------------------------------------------------- sizes the machine cannot hold

@pytest.mark.parametrize("flags, words", [
    (["--num-blocks", str(10**12)], ["KV cache pool of 1000000000000 blocks", "PiB", "host memory", "--num-blocks"]),
    (["--max-num-batched-tokens", str(10**12)], ["step buffers", "PiB", "host memory", "--max-num-batched-tokens"]),
])
def test_a_size_past_the_memory_is_refused_before_allocating(base, capsys, flags, words):
    assert_one_line(*run_cli(capsys, "generate", "hi", "--device", "cpu", "--model", str(base), *flags), *words)


def test_a_model_larger_than_the_memory_names_both_numbers(base, capsys, monkeypatch):
    monkeypatch.setattr("tinyvllm.model.kv_pool.host_memory_available", lambda: 2**20)
    code, lines = generate(base, capsys)
    assert_one_line(code, lines, "the model (weights", "needs", "but only 1.0 MiB of host memory is available",
                    "smaller model")


def test_the_flag_the_message_names_fixes_it(base, tmp_path, capsys):
    model = model_with(base, tmp_path / "model", CONFIG, fields(max_position_embeddings=10**15)(base / CONFIG))
    code, lines = run_cli(capsys, "generate", "hi", "--max-tokens", "1", "--device", "cpu", "--model", str(model),
                          "--max-model-len", "64")
    assert code == 0 and "finish: length" in lines[-1], lines


def test_the_default_cpu_pool_fits_in_the_memory_left(base, monkeypatch):
    """The CPU pool's fixed size is lowered to what the host can still give, rather than refused."""
    available = 200 * 2**20
    monkeypatch.setattr("tinyvllm.model.kv_pool.host_memory_available", lambda: available)
    with LLM(str(base), device="cpu") as llm:
        pool = llm.engine.pool
        assert 0 < (pool.num_blocks + 1) * bytes_per_block(llm.model_config, 4) <= available
