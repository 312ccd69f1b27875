"""Chapter 1 graders: RMSNorm, RoPE, softmax and GQA attention against torch / HF transformers.

Every grader draws fresh random inputs with odd sizes and compares with an implementation that does
not share code with the one under test: transformers' Llama modules, or torch's own ops.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
from transformers import LlamaConfig as HFLlamaConfig  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from chapters.grading import exercises  # noqa: E402
from tests import seeding  # noqa: E402
from tests.numeric import F32, check, close, randn, rel_err, same, torch_attention  # noqa: E402,F401
from tinyvllm import reference  # noqa: E402
from tinyvllm.formats.checkpoints import PRESETS, synth_model  # noqa: E402
from tinyvllm.formats.config import load_config  # noqa: E402
from tinyvllm.model.weights import load_weights  # noqa: E402

# ---------- Exercise 1.1: RMSNorm vs transformers' LlamaRMSNorm ----------

@pytest.mark.ch1
@pytest.mark.parametrize("scale", [1.0, 1e-3, 300.0])  # 1e-3: eps dominates; 300: large activations
def test_rms_norm_matches_llama_rmsnorm(impl, scale, rng):
    T, hidden, eps = 7, 37, float(rng.choice([1e-5, 1e-6]))
    x, w = randn(rng, T, hidden, scale=scale), 1 + randn(rng, hidden, scale=0.2)
    hf = modeling_llama.LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(torch.from_numpy(w))
        ref = hf(torch.from_numpy(x)).numpy()
    check(impl("rms_norm")(x, w, eps), ref, (T, hidden), what=f"rms_norm of {T} rows of {hidden}, values of scale "
          f"{scale}, eps {eps:g}")


@pytest.mark.ch1
def test_rms_norm_works_over_the_last_axis_of_any_rank(impl, rng):
    x, w = randn(rng, 3, 5, 24), randn(rng, 24)
    hf = modeling_llama.LlamaRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.from_numpy(w))
        ref = hf(torch.from_numpy(x)).numpy()
    check(impl("rms_norm")(x, w, 1e-5), ref, x.shape, what="rms_norm of a (3, 5, 24) array (over its last axis)")


@pytest.mark.ch1
def test_rms_norm_leaves_its_input_unchanged(impl, rng):
    """The model adds each layer's output to the residual stream x after normalizing it: x must still be x."""
    x, w = randn(rng, 5, 40, scale=3.0), randn(rng, 40)
    kept = x.copy(), w.copy()
    out = impl("rms_norm")(x, w, 1e-5)
    assert np.array_equal(x, kept[0]), "rms_norm changed x, its input: compute the result in a new array"
    assert np.array_equal(w, kept[1]), "rms_norm changed weight, its input: compute the result in a new array"
    assert not np.shares_memory(out, x), "rms_norm returned x itself: return a new array (x is still needed)"


# ---------- Exercise 1.2: RoPE frequencies vs transformers' LlamaRotaryEmbedding ----------

def hf_inv_freq(cfg) -> np.ndarray:
    """transformers' inv_freq for our config: its default or llama3 rope initializer."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta} if cfg.rope_scaling is None else \
        {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    hf_cfg = HFLlamaConfig(hidden_size=cfg.num_attention_heads * cfg.head_dim, head_dim=cfg.head_dim,
                           num_attention_heads=cfg.num_attention_heads,
                           max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope)
    return modeling_llama.LlamaRotaryEmbedding(hf_cfg).inv_freq.numpy()


@pytest.mark.ch1
@pytest.mark.parametrize("head_dim", [16, 64, 96])
def test_rope_inv_freq_without_scaling(impl, head_dim, rng):
    theta = float(rng.choice([10000.0, 100000.0, 500000.0]))
    cfg = replace(PRESETS["smollm2-135m"], head_dim=head_dim, rope_theta=theta)
    check(impl("rope_inv_freq")(cfg), hf_inv_freq(cfg), (head_dim // 2,),
          what=f"inv_freq, head_dim {head_dim}, rope_theta {theta:g}, no scaling")


@pytest.mark.ch1
@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.1-8b"])
def test_rope_inv_freq_with_llama3_scaling(impl, preset):
    cfg = PRESETS[preset]
    check(impl("rope_inv_freq")(cfg), hf_inv_freq(cfg), (cfg.head_dim // 2,),
          what=f"inv_freq of {preset} (llama3 scaling)")


@pytest.mark.ch1
def test_rope_inv_freq_with_unusual_llama3_parameters(impl, rng):
    """Other factors and an original context of 256, so every branch (kept, ramp, divided) is used."""
    scaling = {"rope_type": "llama3", "factor": float(rng.uniform(2, 40)), "low_freq_factor": 1.5,
               "high_freq_factor": 6.0, "original_max_position_embeddings": 256}
    cfg = replace(PRESETS["llama-3.2-1b"], head_dim=32, rope_theta=10000.0, rope_scaling=scaling)
    check(impl("rope_inv_freq")(cfg), hf_inv_freq(cfg), (16,), what=f"inv_freq with llama3 scaling {scaling}")


# ---------- Exercise 1.3: RoPE rotation vs transformers' apply_rotary_pos_emb ----------

def hf_cos_sin(head_dim: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hf_cfg = HFLlamaConfig(hidden_size=head_dim * 2, head_dim=head_dim, num_attention_heads=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    rotary = modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions)[None])
    return cos[0], sin[0]  # (T, head_dim) each


@pytest.mark.ch1
@pytest.mark.parametrize("T,heads,start", [(7, 5, 0), (1, 3, 1000), (13, 1, 42)])
def test_apply_rope_matches_transformers(impl, T, heads, start, rng):
    d = 24
    x = randn(rng, T, heads, d)
    cos, sin = hf_cos_sin(d, np.arange(start, start + T))
    ref, _ = modeling_llama.apply_rotary_pos_emb(torch.from_numpy(x), torch.from_numpy(x), cos, sin,
                                                 unsqueeze_dim=1)  # (T, d) -> (T, 1, d) over the heads
    check(impl("apply_rope")(x, cos.numpy(), sin.numpy()), ref.numpy(), (T, heads, d),
          what=f"apply_rope on {T} tokens x {heads} heads x {d}, positions {start}..")


@pytest.mark.ch1
def test_apply_rope_keeps_lengths_and_relative_angles(impl, rng):
    """Hand-derived: a rotation keeps each pair's length, and q.k depends only on the position gap."""
    d = 32
    q, k = randn(rng, 1, 1, d), randn(rng, 1, 1, d)
    rope = impl("apply_rope")

    def at(x, pos):
        cos, sin = hf_cos_sin(d, np.array([pos]))
        return rope(x, cos.numpy(), sin.numpy())[0, 0].astype(np.float64)

    pair_len = lambda v: np.hypot(v[: d // 2], v[d // 2:])  # noqa: E731
    close(pair_len(at(q, 17)), pair_len(q[0, 0].astype(np.float64)), "the length of each (i, i + d/2) pair after a "
          "rotation to position 17 (a rotation keeps lengths)", rtol=1e-5)
    close(at(q, 9) @ at(k, 4), at(q, 105) @ at(k, 100), "q.k with q at position 9 and k at 4, against q at 105 and k "
          "at 100 (the same gap: it must not change)", rtol=1e-4)


# ---------- Exercise 1.4: softmax vs torch.softmax ----------

@pytest.mark.ch1
@pytest.mark.parametrize("scale", [1.0, 200.0])  # 200: exp() overflows float32 without the max trick
def test_softmax_matches_torch(impl, scale, rng):
    x = randn(rng, 3, 5, 11, scale=scale)
    check(impl("softmax")(x), torch.softmax(torch.from_numpy(x), dim=-1).numpy(), x.shape,
          what=f"softmax of a (3, 5, 11) array of scale {scale}")


@pytest.mark.ch1
@pytest.mark.parametrize("shift", [0.0, -1e5])  # -1e5: real scores far below any stand-in for -inf such as -1e4
def test_softmax_gives_masked_entries_zero(impl, shift, rng):
    x = randn(rng, 6, 9) + F32(shift)
    x[np.triu_indices(6, k=1, m=9)] = -np.inf  # a causal mask
    out = impl("softmax")(x)
    check(out, torch.softmax(torch.from_numpy(x), dim=-1).numpy(), x.shape,
          what=f"softmax of rows with -inf (masked) entries, the others around {shift:g}")
    masked = out[np.triu_indices(6, k=1, m=9)]
    assert np.all(masked == 0), (f"{int(np.sum(masked != 0))} entries that were -inf got a probability other than 0, "
                                 f"e.g. {masked[masked != 0][0]:.3g}")


# ---------- Exercise 1.5: causal GQA attention vs torch's scaled_dot_product_attention ----------

@pytest.mark.ch1
@pytest.mark.parametrize("T,S,start,H,KVH", [
    (11, 11, 0, 6, 2),    # prefill, 3 query heads per K/V head
    (1, 13, 12, 6, 3),    # one decode step reading a 13-token cache
    (4, 9, 5, 4, 4),      # a chunk of 4 after 5 cached tokens, no grouping (MHA)
    (5, 5, 0, 8, 1),      # all query heads share one K/V head (MQA)
])
def test_attention_matches_torch_sdpa(impl, T, S, start, H, KVH, rng):
    d = 16
    q, k, v = randn(rng, T, H, d, scale=2.0), randn(rng, S, KVH, d, scale=2.0), randn(rng, S, KVH, d)
    check(impl("attention")(q, k, v, start), torch_attention(q, k, v, start), (T, H * d),
          what=f"attention of T={T} queries from position {start} over S={S} keys, {H} heads on {KVH} K/V heads")


# ---------- All five together: a tiny Llama with your functions vs transformers ----------

LLAMA3_SMALL = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}  # small context so every rope branch is used


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, request):
    seed = seeding.seed_for_request(request)  # fresh weights each session, printed if a test fails
    path = synth_model("llama-3.2-1b", tmp_path_factory.mktemp("tiny") / "model", seed=seed,
                       num_hidden_layers=2, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                       head_dim=16, intermediate_size=160, vocab_size=301, rope_theta=10000.0,
                       rope_scaling=LLAMA3_SMALL, bos_token_id=1, eos_token_ids=(2,))
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.mark.ch1
def test_reference_model_with_your_functions_matches_transformers(impl, monkeypatch, tiny_llama, rng):
    """Prefill 20 tokens, then decode 9 one at a time through the KV cache: logits vs LlamaForCausalLM."""
    path, hf = tiny_llama
    for name in exercises(1).REFERENCE:
        monkeypatch.setattr(reference, name, impl(name))
    cfg = load_config(path)
    model = reference.ReferenceModel(cfg, load_weights(path, cfg).views)
    ids = rng.integers(0, cfg.vocab_size, 29)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)[None]).logits[0].numpy()
    cache = model.new_cache(len(ids))
    prefill = model.forward(ids[:20], cache)
    decoded = [model.forward(ids[t:t + 1], cache, all_logits=False) for t in range(20, len(ids))]
    check(prefill, ref[:20], (20, cfg.vocab_size), tol=1e-4, what="the logits of the 20-token prefill")
    check(np.stack(decoded), ref[20:], (9, cfg.vocab_size), tol=1e-4, what="the logits of 9 decode steps")
    same(np.stack(decoded).argmax(-1), ref[20:].argmax(-1), "the greedy tokens of the 9 decode steps vs transformers'")
