"""The CPU engine's prefill (numpy twins, fused weights, buffers) against the reference and transformers."""
import numpy as np
import pytest

from tests.numeric import rel_err
from tinyvllm.formats.config import load_config
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill
from tinyvllm.model.weights import load_weights
from tinyvllm.reference import ReferenceModel


@pytest.fixture(scope="module")
def smol(default_model_dir):
    cfg = load_config(default_model_dir)
    return Model(default_model_dir, device="cpu", max_num_batched_tokens=128), ReferenceModel(cfg, load_weights(default_model_dir, cfg).views)


def test_cpu_prefill_matches_reference(smol):
    model, ref = smol
    ids = np.random.default_rng(5).integers(0, model.cfg.vocab_size, 77).tolist()
    cache = ref.new_cache(77)
    expected = ref.forward(ids, cache)
    logits, kv = prefill(model, ids, all_logits=True)
    assert rel_err(logits, expected) < 1e-5
    last, _ = prefill(model, ids)
    assert rel_err(last, expected[-1]) < 1e-5
    for i, (k, v) in enumerate(kv):  # the K/V handed to the cache are the reference's, RoPE included
        assert rel_err(k, cache.k[i, :77]) < 1e-5 and rel_err(v, cache.v[i, :77]) < 1e-5


def test_cpu_prefill_rejects_too_long_prompt(smol):
    from tinyvllm.errors import TinyVLLMError
    with pytest.raises(TinyVLLMError, match="step buffers hold 1 to 128"):
        prefill(smol[0], [1] * 129)


def test_fused_weights_are_stacked_hf_tensors(smol, default_model_dir):
    """qkv = [q; k; v] and gate_up = [gate; up] by rows, checked against the checkpoint read by `safetensors`."""
    import torch
    from safetensors.torch import load_file as load_torch
    model, _ = smol
    t = load_torch(str(default_model_dir / "model.safetensors"))
    p = "model.layers.7."
    qkv = torch.cat([t[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).float().numpy()
    gate_up = torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]).float().numpy()
    np.testing.assert_array_equal(model.layers[7].qkv, qkv)
    np.testing.assert_array_equal(model.layers[7].gate_up, gate_up)
