"""Chapter 5 on the CPU: the KV cache, decode attention's NumPy twin, the decode step, greedy vs transformers.

- decode attention (numpy_ops.decode_attention) vs torch SDPA on random caches of lengths 1 .. 4097,
  each sequence at its own place in a cache whose other slots are NaN;
- teacher-forced parity: logits for token t from prefill of t+1 tokens == prefill of t tokens + one
  decode step (catches a RoPE position mismatch between prefill and decode);
- a batched decode step equals each sequence decoded alone;
- the engine's greedy generation equals transformers' greedy `generate` for 64 tokens on 5 prompts.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.numeric import randn, random_cache, rel_err, torch_attention
from tests.test_reference import CHATS, GREEDY_TOKENS, hf_greedy, load_hf, up_to_stop
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.checkpoints import synth_model
from tinyvllm.model.backend import numpy_ops
from tinyvllm.model.decode import decode_step
from tinyvllm.model.kv_pool import ContiguousKVCache
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill

LENGTHS = [1, 15, 16, 17, 1000, 4097]


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (9, 3, 64), (4, 4, 16), (8, 1, 128)])
def test_decode_attention_twin_matches_torch_sdpa(heads, kv_heads, head_dim, rng):
    k_cache, v_cache, starts, seqs = random_cache(rng, LENGTHS, kv_heads, head_dim)
    n, q_cols, kv_cols = len(seqs), heads * head_dim, kv_heads * head_dim
    qkv = randn(rng, n, q_cols + 2 * kv_cols, scale=2.0)
    qkv[:, q_cols:] = np.nan  # decode attention reads only the Q columns of the new rows
    lengths = np.array([len(k) for k, _ in seqs], np.int32)
    out = np.full((n + 1, q_cols), np.nan, np.float32)
    numpy_ops.decode_attention(qkv, k_cache, v_cache, starts, lengths, out[:n], heads)
    for b, (k, v) in enumerate(seqs):
        q = qkv[b, :q_cols].reshape(1, heads, head_dim)
        expected = torch_attention(q, k, v, start_pos=len(k) - 1)[0]  # the newest position sees every key
        assert rel_err(out[b], expected) < 1e-5, f"sequence of {len(k)} keys"
    assert np.isnan(out[n]).all(), "wrote past the last row"


def test_store_kv_puts_each_row_in_its_slot(rng):
    heads, kv_heads, d, T = 6, 2, 8, 5
    qkv = randn(rng, T, (heads + 2 * kv_heads) * d)
    k_cache, v_cache = np.zeros((20, kv_heads, d), np.float32), np.zeros((20, kv_heads, d), np.float32)
    slots = rng.choice(20, T, replace=False).astype(np.int32)
    numpy_ops.store_kv(qkv, k_cache, v_cache, slots, heads)
    for t, s in enumerate(slots):
        np.testing.assert_array_equal(k_cache[s].reshape(-1), qkv[t, heads * d:(heads + kv_heads) * d])
        np.testing.assert_array_equal(v_cache[s].reshape(-1), qkv[t, (heads + kv_heads) * d:])
    untouched = np.setdiff1d(np.arange(20), slots)
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


# ---------------------------------------------------------------- the decode step

@pytest.fixture(scope="module")
def smol(default_model_dir):
    return Model(default_model_dir, "cpu", max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def tiny_llama3(tmp_path_factory):
    """Llama 3 RoPE scaling with a short original context, GQA 4:1, untied head: what decode must rotate right."""
    out = synth_model("llama-3.2-1b", tmp_path_factory.mktemp("tiny") / "m", seed=4, num_hidden_layers=2,
                      hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                      intermediate_size=96)
    return Model(out, "cpu", max_num_batched_tokens=300)


def prompt_ids(model: Model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.cfg.vocab_size, n).tolist()


@pytest.mark.parametrize("which, t", [("smol", 1), ("smol", 37), ("smol", 200), ("tiny_llama3", 5),
                                      ("tiny_llama3", 150), ("tiny_llama3", 299)])
def test_teacher_forced_prefill_equals_prefill_plus_one_decode_step(request, which, t):
    model = request.getfixturevalue(which)
    ids = prompt_ids(model, t + 1, seed=t)
    full, _ = prefill(model, ids)                         # the logits after t+1 tokens, in one prefill
    cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=t + 1)
    prefill(model, ids[:t], cache=cache)                  # t tokens, then token t through decode
    step = decode_step(model, [ids[t]], cache, [0])[0]
    assert cache.lengths == {0: t + 1}
    err = rel_err(step, full)
    assert err < 1e-5, f"t={t}: relative error {err:.2e}"


def test_batched_decode_equals_each_sequence_alone(smol):
    """Four sequences of different lengths in ONE decode step, for 3 steps, vs each decoded alone."""
    lengths, steps = [3, 40, 17, 90], 3
    prompts = [prompt_ids(smol, n, seed=n) for n in lengths]
    nexts = [prompt_ids(smol, steps, seed=100 + n) for n in lengths]
    cache = ContiguousKVCache(smol.cfg, smol.ops, num_seqs=4, max_len=100)
    for s in (2, 0, 3, 1):  # filled out of order: a sequence's slots depend on its id, not on arrival
        prefill(smol, prompts[s], cache=cache, seq=s)
    together = [decode_step(smol, [nexts[s][i] for s in range(4)], cache, [0, 1, 2, 3]) for i in range(steps)]
    for s in range(4):
        alone = ContiguousKVCache(smol.cfg, smol.ops, num_seqs=1, max_len=100)
        prefill(smol, prompts[s], cache=alone)
        for i in range(steps):
            logits = decode_step(smol, [nexts[s][i]], alone, [0])[0]
            assert rel_err(together[i][s], logits) < 1e-5, f"sequence {s}, step {i}"


def test_cache_refuses_to_overflow(smol):
    cache = ContiguousKVCache(smol.cfg, smol.ops, num_seqs=1, max_len=4)
    prefill(smol, [1, 2, 3, 4], cache=cache)
    with pytest.raises(TinyVLLMError, match="needs 5 tokens of KV cache but holds 4"):
        decode_step(smol, [5], cache, [0])
    with pytest.raises(TinyVLLMError, match="needs 6 tokens of KV cache but holds 4"):
        prefill(smol, [1, 2], cache=cache)


def test_cache_size_is_two_tensors_per_layer_and_token(smol):
    cfg = smol.cfg
    cache = ContiguousKVCache(cfg, smol.ops, num_seqs=3, max_len=50)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # K and V, float32
    assert cache.nbytes == 3 * 50 * per_token


# ---------------------------------------------------------------- greedy generation vs transformers

@pytest.mark.slow
def test_engine_greedy_generation_matches_transformers_generate(default_model_dir):
    from tinyvllm import LLM, SamplingParams
    llm, hf = LLM(default_model_dir, device="cpu"), load_hf(default_model_dir)
    stop_ids = set(llm.stop_token_ids)
    lengths = []
    for chat in CHATS:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": chat}])
        ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS))[0].token_ids
        theirs = up_to_stop(hf_greedy(hf, ids, GREEDY_TOKENS), stop_ids)
        first_difference = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        assert ours == theirs, f"{chat!r}: tokens differ from position {first_difference}"
        lengths.append(len(ours))
    assert max(lengths) == GREEDY_TOKENS  # at least one answer runs the full 64 tokens
    assert torch.get_default_dtype() == torch.float32
