"""End-to-end prefill on the GPU against HF transformers on the GPU, on random-weight Llama 3 configs
created and saved by transformers itself (one with Llama 3.2 1B's real dimensions and rope scaling)."""
import numpy as np
import pytest

from tests.gpu_helpers import requires_gpu
from tests.numeric import rel_err

pytestmark = [pytest.mark.gpu, requires_gpu]

ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
CONFIGS = {
    "tiny-gqa4": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, vocab_size=3001, tie_word_embeddings=False),
    "tiny-mha-hd128": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4, head_dim=128, vocab_size=2000, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
}


def save_random_llama(path, dims: dict, seed: int = 0):
    """A LlamaForCausalLM with weights at a scale where argmax is meaningful, saved in bf16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(**dims, rope_theta=500000.0, rope_scaling=ROPE_LLAMA3, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:  # logits with a spread of ~5: a clear argmax
                p.normal_(0, 5 / dims["hidden_size"] ** 0.5)
            elif "o_proj" in name or "down_proj" in name:  # residual branches scaled down, as in trained
                p.normal_(0, (p.shape[1] * 2 * dims["num_hidden_layers"]) ** -0.5)  # nets: not chaotic
            else:
                p.normal_(0, p.shape[1] ** -0.5)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def save_random_llama_with_tokenizer(path, dims: dict, seed: int = 0):
    """save_random_llama, plus Llama 3's tokenizer files: what LLM() needs beside the weights."""
    import shutil

    from tinyvllm.formats.checkpoints import llama3_tokenizer_dir
    save_random_llama(path, dims, seed)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama3_tokenizer_dir() / name, path / name)
    return path


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_matches_transformers(tmp_path, name):
    import cupy as cp
    import torch
    from transformers import LlamaForCausalLM

    from tinyvllm.model.model import Model
    from tinyvllm.model.prefill import prefill

    save_random_llama(tmp_path, CONFIGS[name])
    T = 700 if name == "llama-3.2-1b" else 300
    ids = np.random.default_rng(1).integers(0, CONFIGS[name]["vocab_size"], T)
    logits_of = {}
    for dtype in (torch.float32, torch.bfloat16):  # fp32: the reference; bf16: what HF itself reaches
        hf = LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=dtype).cuda().eval()
        with torch.no_grad():
            logits_of[dtype] = hf(torch.tensor(ids[None], device="cuda")).logits[0].float().cpu().numpy()
        del hf
        torch.cuda.empty_cache()
    expected, hf_bf16 = logits_of[torch.float32], logits_of[torch.bfloat16]

    model = Model(tmp_path, device="cuda", max_num_batched_tokens=1024)
    logits, kv = prefill(model, ids.tolist(), all_logits=True)
    got = cp.asnumpy(logits)
    err = rel_err(got, expected)
    agree = float((got.argmax(-1) == expected.argmax(-1)).mean())
    print(f"{name}: rel error {err:.2e}, argmax agreement {agree:.4f} over {T} positions; transformers in "
          f"bf16: {rel_err(hf_bf16, expected):.2e}, {(hf_bf16.argmax(-1) == expected.argmax(-1)).mean():.4f}")
    assert err < 2e-2
    assert agree >= 0.99
    last, _ = prefill(model, ids.tolist())
    np.testing.assert_allclose(cp.asnumpy(last), got[-1], rtol=1e-3, atol=1e-3)
    assert len(kv) == CONFIGS[name]["num_hidden_layers"]
    assert kv[0][0].shape == (T, CONFIGS[name]["num_key_value_heads"], CONFIGS[name]["head_dim"])
