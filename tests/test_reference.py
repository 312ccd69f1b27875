"""The NumPy reference model against the oracle: HF transformers' LlamaForCausalLM, torch float32, CPU.

Three kinds of checks:
- the default model (SmolLM2-135M-Instruct): logits of every position, and 64 greedy tokens decoded
  with the KV cache, against transformers on chat prompts;
- tiny random checkpoints written by transformers itself, one per feature the engine must get right
  (llama3 RoPE scaling, GQA ratios, tied/untied lm_head, head_dim != hidden/heads, bf16 and f32 files);
- teacher-forced parity: prefill of t+1 tokens == prefill of t tokens + one cached decode step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

from tests.numeric import rel_err
from tinyvllm.formats.config import load_config
from tinyvllm.formats.tokenizer import load_tokenizer
from tinyvllm.model.weights import load_weights
from tinyvllm.reference import ReferenceModel, rope_inv_freq

GREEDY_TOKENS = 64
CHATS = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain in three sentences why the sky is blue.",
    "List five fruits and one fact about each.",
    "How do I reverse a list in Python? Show code.",
]


def load_reference(model_dir: Path) -> ReferenceModel:
    cfg = load_config(model_dir)
    return ReferenceModel(cfg, load_weights(model_dir, cfg).views)


def load_hf(model_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logits(model: LlamaForCausalLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def greedy_with_cache(model: ReferenceModel, prompt: list[int], n: int) -> list[int]:
    """What tinyvllm.entrypoints.llm.LLM does at temperature 0: one prefill, then one cached decode step per token."""
    cache = model.new_cache(len(prompt) + n)
    logits = model.forward(prompt, cache, all_logits=False)
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = model.forward(tokens[-1:], cache, all_logits=False)
    return tokens


def up_to_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    """The tokens up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i + 1]
    return tokens


# ---------------------------------------------------------------- the default model

@pytest.fixture(scope="module")
def default_hf(default_model_dir):
    return load_hf(default_model_dir)


@pytest.fixture(scope="module")
def default_ref(default_model_dir):
    return load_reference(default_model_dir)


@pytest.fixture(scope="module")
def chat_prompts(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]


@pytest.mark.slow
def test_default_model_logits_match_transformers(default_ref, default_hf, chat_prompts):
    errors = []
    for ids in chat_prompts:
        ours, theirs = default_ref.forward(ids), hf_logits(default_hf, ids)
        assert ours.shape == theirs.shape == (len(ids), default_ref.cfg.vocab_size)
        assert ours.dtype == np.float32
        errors.append(rel_err(ours, theirs))
    print("default model logits rel. errors:", ", ".join(f"{e:.2e}" for e in errors))
    assert max(errors) < 1e-4, errors


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=n, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_default_model_greedy_tokens_match_transformers_generate(default_ref, default_hf, chat_prompts):
    hf_eos = default_hf.generation_config.eos_token_id
    stop_ids = set(default_ref.cfg.eos_token_ids) | set([hf_eos] if isinstance(hf_eos, int) else hf_eos)
    assert stop_ids == {2}  # <|im_end|>
    lengths = []
    for ids in chat_prompts:
        theirs = up_to_stop(hf_greedy(default_hf, ids, GREEDY_TOKENS), stop_ids)
        ours = up_to_stop(greedy_with_cache(default_ref, ids, GREEDY_TOKENS), stop_ids)
        first_difference = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        assert ours == theirs, f"prompt {ids[-12:]}: tokens differ from position {first_difference}"
        lengths.append(len(ours))
    assert max(lengths) == GREEDY_TOKENS  # some answers run the full 64 tokens, past the easy first few


# ---------------------------------------------------------------- tiny checkpoints written by transformers

LLAMA3_SMALL_ORIGINAL = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}
LLAMA3_REAL = {**LLAMA3_SMALL_ORIGINAL, "original_max_position_embeddings": 8192}
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, head_dim=16, rope_theta=10000.0,
            rms_norm_eps=1e-5, max_position_embeddings=2048, tie_word_embeddings=False)
# name: (config overrides, dtype written to disk, number of tokens)
TINY = {
    "gqa1-untied-f32": (dict(), torch.float32, 48),
    "gqa3-tied-bf16": (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                            tie_word_embeddings=True), torch.bfloat16, 48),
    "gqa4-head_dim24-bf16": (dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24), torch.bfloat16, 48),
    # wavelengths 2*pi*10000^(i/16): below 16 (kept), 16..64 (ramp), above 64 (divided by 32), and
    # positions up to 199, well past the 64 "original" ones
    "llama3-original64-tied-f32": (dict(num_key_value_heads=2, head_dim=32, rope_scaling=LLAMA3_SMALL_ORIGINAL,
                                        tie_word_embeddings=True), torch.float32, 200),
    # Llama 3.2's own numbers: theta 5e5, head_dim 64 -> frequencies 0-14 kept, 15-17 ramp, 18-31 divided
    "llama3-original8192-bf16": (dict(hidden_size=128, num_key_value_heads=1, head_dim=64, rope_theta=500000.0,
                                      rope_scaling=LLAMA3_REAL, max_position_embeddings=131072),
                                 torch.bfloat16, 600),
}


def write_tiny_checkpoint(out_dir: Path, overrides: dict, dtype: torch.dtype, seed: int = 0) -> Path:
    """A random Llama saved by transformers itself, weights scaled so attention is peaked, norms not 1."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(HFLlamaConfig(**{**BASE, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm weights: a norm applied with weight 1 would hide a missing multiply
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0, 1.0)
            else:  # 1.5/sqrt(fan_in): large enough that softmax is far from uniform, small enough to stay finite
                p.normal_(0, 1.5 / p.shape[1] ** 0.5)
    model.to(dtype).save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request, tmp_path_factory):
    overrides, dtype, n_tokens = TINY[request.param]
    model_dir = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), overrides, dtype)
    ids = np.random.default_rng(1).integers(0, BASE["vocab_size"], n_tokens).tolist()
    return request.param, load_reference(model_dir), load_hf(model_dir), ids


def test_tiny_config_is_read_like_transformers(tiny):
    name, ours, theirs, _ = tiny
    hf = theirs.config
    assert ours.cfg.num_key_value_heads == hf.num_key_value_heads
    assert ours.cfg.head_dim == hf.head_dim
    assert ours.cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert ("lm_head.weight" in ours.w) == (not hf.tie_word_embeddings)
    assert (ours.cfg.rope_scaling is not None) == (hf.rope_parameters["rope_type"] == "llama3"), name


def test_tiny_rope_frequencies_match_transformers(tiny):
    name, ours, theirs, _ = tiny
    hf_inv_freq = theirs.model.rotary_emb.inv_freq.double().numpy()
    assert rel_err(rope_inv_freq(ours.cfg), hf_inv_freq) < 1e-6, name


def test_tiny_logits_match_transformers(tiny):
    name, ours, theirs, ids = tiny
    err = rel_err(ours.forward(ids), hf_logits(theirs, ids))
    print(f"{name}: logits rel. error {err:.2e}")
    assert err < 1e-4, f"{name}: rel. error {err:.2e}"


# ---------------------------------------------------------------- teacher-forced parity

def assert_prefill_equals_prefill_plus_decode(model: ReferenceModel, ids: list[int], t: int) -> float:
    """Logits for the token after ids[:t+1]: one prefill of t+1 tokens vs prefill of t + one decode step."""
    full = model.forward(ids[:t + 1])[t]
    cache = model.new_cache(t + 1)
    model.forward(ids[:t], cache, all_logits=False)
    step = model.forward(ids[t:t + 1], cache, all_logits=False)
    assert cache.length == t + 1
    err = rel_err(step, full)
    assert err < 1e-5, f"t={t}: rel. error {err:.2e}"
    return err


def test_teacher_forced_parity_default_model(default_ref, chat_prompts):
    ids = chat_prompts[1]
    errors = [assert_prefill_equals_prefill_plus_decode(default_ref, ids, t)
              for t in (len(ids) // 2, len(ids) - 1)]
    print("prefill vs prefill+decode rel. errors:", ", ".join(f"{e:.2e}" for e in errors))


def test_teacher_forced_parity_tiny_llama3(tmp_path):
    overrides, dtype, n_tokens = TINY["llama3-original64-tied-f32"]
    model = load_reference(write_tiny_checkpoint(tmp_path, overrides, dtype, seed=5))
    ids = np.random.default_rng(2).integers(0, BASE["vocab_size"], n_tokens).tolist()
    for t in (5, 63, 64, 150, n_tokens - 1):  # around and past the original context of 64
        assert_prefill_equals_prefill_plus_decode(model, ids, t)
