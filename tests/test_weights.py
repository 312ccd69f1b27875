"""From checkpoint files to one blob: sharded checkpoints, bf16 conversions, the buffer plan, `info`.

References: transformers writes the sharded checkpoints, torch converts bf16, the buffer sizes are
worked out by hand, and `info` is run as a user runs it (a subprocess).
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.bf16 import bf16_bits_to_float32, float32_to_bf16_bits
from tinyvllm.formats.checkpoints import PRESETS
from tinyvllm.formats.config import load_config
from tinyvllm.model.buffers import ALIGN, blob_size, plan_buffers
from tinyvllm.model.weights import load_weights, plan_weights

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent


# ---- sharded checkpoints, written by transformers ---------------------------------------------

@pytest.fixture(scope="module")
def transformers_checkpoints(tmp_path_factory):
    """The same random tiny Llama saved twice by transformers: one file, and shards + index.json."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="40KB")
    return single, sharded, {k: v.to(torch.float32).numpy() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_like_the_single_file(transformers_checkpoints):
    single, sharded, state = transformers_checkpoints
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) >= 2 and (sharded / "model.safetensors.index.json").is_file(), shards
    cfg = load_config(sharded)
    one, many = load_weights(single, cfg).views, load_weights(sharded, cfg).views
    assert one.keys() == many.keys() == state.keys()
    for name, ref in state.items():  # torch's own bf16 -> f32 of the weights transformers saved
        assert np.array_equal(one[name], ref) and np.array_equal(many[name], ref), name


def test_sharded_checkpoint_missing_a_shard(transformers_checkpoints, tmp_path):
    broken = shutil.copytree(transformers_checkpoints[1], tmp_path / "broken")
    victim = sorted(broken.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(TinyVLLMError, match=f"{victim.name}, which is missing"):
        load_weights(broken, load_config(broken))


# ---- one blob -------------------------------------------------------------------------------

def test_load_weights_makes_one_aligned_blob(default_model_dir):
    from safetensors import safe_open
    cfg = load_config(default_model_dir)
    w = load_weights(default_model_dir, cfg)
    start = w.blob.ctypes.data
    assert w.blob.ndim == 1 and w.blob.nbytes == w.nbytes == blob_size(w.regions)
    spans = []
    for name, view in w.views.items():
        assert np.shares_memory(view, w.blob) and view.dtype == np.float32, name
        address = view.ctypes.data
        assert address % ALIGN == 0, f"{name} starts at an unaligned address"
        assert start <= address and address + view.nbytes <= start + w.blob.nbytes, f"{name} lies outside the blob"
        spans.append((address, address + view.nbytes))
    spans.sort()
    assert all(end <= begin for (_, end), (begin, _) in zip(spans, spans[1:])), "two views overlap"
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            assert np.array_equal(w.views[name], f.get_tensor(name).to(torch.float32).numpy()), name


# ---- bf16 against torch -------------------------------------------------------------------------

def test_widening_matches_torch_on_every_bf16():
    bits = np.arange(2**16, dtype=np.uint16)
    ref = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32).numpy()
    assert np.array_equal(bf16_bits_to_float32(bits).view(np.uint32), ref.view(np.uint32))


def test_narrowing_matches_torch_round_to_nearest_even(rng):
    u = rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32)
    u[:100_000] = (u[:100_000] & 0xFFFF0000) | 0x8000   # ties: exactly halfway between two bf16
    u[100_000:150_000] &= 0x807FFFFF                    # subnormals
    specials = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0, 3.4028235e38, 1e-45, -1e-45], dtype=np.float32)
    x = np.concatenate([u.view(np.float32), specials, rng.standard_normal(10_000, dtype=np.float32)])
    ours = float32_to_bf16_bits(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], ref[~nan])
    assert np.isnan(bf16_bits_to_float32(ours[nan])).all()  # NaN stays NaN (torch picks its own payload)


# ---- the buffer plan ---------------------------------------------------------------------------

def test_plan_buffers_sizes_by_hand():
    cfg = PRESETS["smollm2-135m"]  # hidden 576, 9 heads x 64, 3 KV heads, FFN 1536, vocab 49152
    regions = {r.name: r for r in plan_buffers(cfg, step_tokens=100, dtype="bf16")}
    expected = {"residual": (100, 576), "normed": (100, 576), "qkv": (100, 576 + 2 * 192),
                "attn_out": (100, 576), "delta": (100, 576), "gate_up": (100, 2 * 1536), "mlp_act": (100, 1536)}
    assert {n: r.shape for n, r in regions.items()} == expected
    for name, r in regions.items():
        itemsize = 4 if name == "residual" else 2  # the residual sum stays f32
        assert r.nbytes == math.prod(r.shape) * itemsize and r.offset % ALIGN == 0
    assert regions["normed"].offset == 230_400  # 100 x 576 x 4 = 230,400 bytes, already aligned
    assert regions["qkv"].offset == 230_400 + 115_200
    assert regions["attn_out"].offset == 345_600 + 192_000
    last = regions["mlp_act"]
    assert blob_size(list(regions.values())) == last.offset + 100 * 1536 * 2


def test_plan_weights_of_llama_3_2_1b():
    regions = plan_weights(PRESETS["llama-3.2-1b"], "bf16")
    assert len(regions) == 1 + 16 * 9 + 1  # tied embeddings: no lm_head
    params = 128256 * 2048 + 16 * (2 * 2048 + 2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192) + 2048
    assert sum(r.nbytes for r in regions) == 2 * params == 2_471_628_800
    assert blob_size(regions) == 2 * params  # every bf16 tensor here is a multiple of 256 bytes


# ---- python -m tinyvllm info --------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinyvllm", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("device, itemsize", [("cpu", 4), ("cuda", 2)])
def test_info_json_lists_every_weight(default_model_dir, device, itemsize):
    from safetensors import safe_open
    run = run_cli("info", "--json", "--device", device)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    weights = report["weights"]   # the engine's layout: each region the checkpoint's tensors stacked by rows
    assert sorted(src for r in weights for src in r["sources"]) == sorted(shapes), "every tensor in one region"
    for r in weights:
        parts = [shapes[src] for src in r["sources"]]
        assert r["shape"] == [sum(p[0] for p in parts), *parts[0][1:]], f"{r['name']}: rows of {r['sources']}"
    for r in weights:
        assert r["dtype"] == {4: "f32", 2: "bf16"}[itemsize]
        assert r["nbytes"] == math.prod(r["shape"]) * itemsize and r["offset"] % ALIGN == 0
    ends = sorted((r["offset"], r["offset"] + r["nbytes"]) for r in weights)
    gaps = [b - e for (_, e), (b, _) in zip(ends, ends[1:])]
    assert all(0 <= g < ALIGN for g in gaps), "regions overlap or leave more than alignment padding"
    payload = sum(r["nbytes"] for r in weights)
    assert report["weights_bytes"] == ends[-1][1] == payload + sum(gaps)
    assert sum(report["weights_by_kind"].values()) == payload
    assert report["buffers_bytes"] == max(r["offset"] + r["nbytes"] for r in report["buffers"])
    assert report["total_bytes"] == report["weights_bytes"] + report["buffers_bytes"]
    if device == "cpu":  # 576 x 4 bytes is 9 x 256: nothing to pad, the totals are the plain sums
        assert report["weights_bytes"] == payload
        assert report["buffers_bytes"] == sum(r["nbytes"] for r in report["buffers"])


def test_info_on_a_bad_path_is_one_line(tmp_path):
    run = run_cli("info", "--model", str(tmp_path / "no-such-model"))
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert "no-such-model" in run.stderr and run.stdout == ""
