"""Chapter 5 on the GPU: the decode kernels against their NumPy twins, the decode step against prefill,
GPU generation against transformers' teacher-forced logits, and sampling on the device."""
import numpy as np
import pytest

from tests.gpu_helpers import NAN_BF16, bf16_pair, from_bf16, nan_bf16, requires_gpu
from tests.numeric import random_cache, rel_err
from tests.test_decode import LENGTHS
from tests.test_gpu_prefill import CONFIGS, save_random_llama_with_tokenizer
from tinyvllm.formats.bf16 import float32_to_bf16_bits
from tinyvllm.model.backend import numpy_ops as twin

pytestmark = [pytest.mark.gpu, requires_gpu]


def to_gpu_bf16(a: np.ndarray):
    """float32 (NaN included) -> bf16 bits on the GPU, and the float32 values the GPU really holds."""
    import cupy as cp

    from tinyvllm.formats.bf16 import bf16_bits_to_float32
    bits = float32_to_bf16_bits(a)
    return cp.asarray(bits), bf16_bits_to_float32(bits)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (9, 3, 64), (8, 1, 128), (4, 4, 16),
                                                       (16, 8, 32), (24, 3, 128)])
def test_decode_attention_kernel_matches_twin(heads, kv_heads, head_dim, rng):
    import cupy as cp

    from tinyvllm.model.backend import cuda_ops
    k32, v32, starts, seqs = random_cache(rng, LENGTHS, kv_heads, head_dim)   # NaN between the sequences
    (k_gpu, k32), (v_gpu, v32) = to_gpu_bf16(k32), to_gpu_bf16(v32)
    n, q_cols, kv_cols = len(seqs), heads * head_dim, kv_heads * head_dim
    qkv32, qkv = bf16_pair(rng, (n, q_cols + 2 * kv_cols), scale=2.0)
    lengths = np.array([len(k) for k, _ in seqs], np.int32)
    out = nan_bf16((n + 1, q_cols))
    cuda_ops.decode_attention(qkv, k_gpu, v_gpu, cp.asarray(starts), cp.asarray(lengths), out[:n], heads)
    expected = np.empty((n, q_cols), np.float32)
    twin.decode_attention(qkv32, k32, v32, starts, lengths, expected, heads)
    got = from_bf16(out)
    assert np.isnan(got[n]).all(), "wrote past the last row"
    for b in range(n):
        assert not np.isnan(got[b]).any(), f"row {b} ({lengths[b]} keys): NaN (read outside its keys?)"
        err = rel_err(got[b], expected[b])
        assert err < 1e-2, f"row {b} ({lengths[b]} keys): relative error {err:.2e}"


def test_store_kv_kernel_matches_twin(rng):
    import cupy as cp

    from tinyvllm.model.backend import cuda_ops
    heads, kv_heads, d, T, slots_total = 32, 8, 64, 37, 200
    qkv32, qkv = bf16_pair(rng, (T, (heads + 2 * kv_heads) * d))
    slots = rng.choice(slots_total, T, replace=False).astype(np.int32)
    k_gpu, v_gpu = (cp.full((slots_total, kv_heads, d), NAN_BF16, cp.uint16) for _ in range(2))
    cuda_ops.store_kv(qkv, k_gpu, v_gpu, cp.asarray(slots), heads)
    k32, v32 = np.full((slots_total, kv_heads, d), np.nan, np.float32), np.full((slots_total, kv_heads, d), np.nan, np.float32)
    twin.store_kv(qkv32, k32, v32, slots, heads)
    np.testing.assert_array_equal(from_bf16(k_gpu), k32)  # exact: a copy, NaN where no slot was written
    np.testing.assert_array_equal(from_bf16(v_gpu), v32)


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    from tinyvllm.model.model import Model
    path = save_random_llama_with_tokenizer(tmp_path_factory.mktemp("gqa4"), CONFIGS["tiny-gqa4"], seed=3)
    return path, Model(path, device="cuda", max_num_batched_tokens=1024)


@pytest.mark.parametrize("t", [1, 16, 17, 300, 1000])
def test_teacher_forced_prefill_equals_prefill_plus_decode_step(gpu_model, t):
    import cupy as cp

    from tinyvllm.model.decode import decode_step
    from tinyvllm.model.kv_pool import ContiguousKVCache
    from tinyvllm.model.prefill import prefill
    _, model = gpu_model
    ids = np.random.default_rng(t).integers(0, model.cfg.vocab_size, t + 1).tolist()
    full = cp.asnumpy(prefill(model, ids)[0])
    cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=t + 1)
    prefill(model, ids[:t], cache=cache)
    step = cp.asnumpy(decode_step(model, [ids[t]], cache, [0])[0])
    err = rel_err(step, full)
    print(f"t={t}: prefill vs prefill + decode: rel error {err:.2e}")
    assert err < 2e-2


def test_batched_decode_equals_single_sequence_decode(gpu_model):
    import cupy as cp

    from tinyvllm.model.decode import decode_step
    from tinyvllm.model.kv_pool import ContiguousKVCache
    from tinyvllm.model.prefill import prefill
    _, model = gpu_model
    lengths, rng = [5, 300, 64, 17, 1000, 1], np.random.default_rng(0)
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in lengths]
    nxt = rng.integers(0, model.cfg.vocab_size, len(lengths)).tolist()
    cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=len(lengths), max_len=1001)
    for s, p in enumerate(prompts):
        prefill(model, p, cache=cache, seq=s)
    together = cp.asnumpy(decode_step(model, nxt, cache, list(range(len(lengths)))))
    for s, p in enumerate(prompts):
        alone = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=len(p) + 1)
        prefill(model, p, cache=alone)
        err = rel_err(together[s], cp.asnumpy(decode_step(model, [nxt[s]], alone, [0])[0]))
        assert err < 1e-2, f"sequence {s} ({lengths[s]} tokens): {err:.2e}"


def test_gpu_greedy_generation_follows_transformers(gpu_model):
    """Generate 48 tokens on the GPU (prefill + decode steps), then feed prompt + output to transformers
    (fp32) in one pass: every generated token must be transformers' argmax, or within bf16 noise of it."""
    import torch
    from transformers import LlamaForCausalLM

    from tinyvllm import LLM, SamplingParams
    path, _ = gpu_model
    llm = LLM(str(path), device="cuda", num_blocks=64)
    prompt = np.random.default_rng(7).integers(0, llm.model_config.vocab_size, 200).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0]
    assert len(out.token_ids) == 48
    hf = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids], device="cuda")).logits[0, len(prompt) - 1:-1].cpu().numpy()
    chosen = logits[np.arange(48), out.token_ids]
    gap = (logits.max(-1) - chosen) / logits.std(-1)  # how far below the best our token was, in std units
    agree = float((logits.argmax(-1) == np.array(out.token_ids)).mean())
    print(f"argmax agreement with transformers: {agree:.3f}, worst gap {gap.max():.3f} std")
    assert agree >= 0.9 and gap.max() < 0.1


def test_gpu_sampling_matches_cpu_sampling(rng):
    """The same logits and seed pick the same token on both devices (one uniform number from the host)."""
    import cupy as cp

    from tinyvllm import SamplingParams
    from tinyvllm.model.sampler import sample
    logits = (rng.standard_normal(128256) * 3).astype(np.float32)
    on_gpu = cp.asarray(logits)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
                   SamplingParams(temperature=1.0, top_k=50, seed=2), SamplingParams(temperature=1.2, min_p=0.05)):
        for seed in range(20):
            cpu = sample(logits, params, np.random.default_rng(seed))
            gpu = sample(on_gpu, params, np.random.default_rng(seed))
            assert cpu == gpu, f"{params}: seed {seed}: cpu {cpu}, gpu {gpu}"


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("K, N, f32_out", [(2048, 3072, False), (8192, 2048, False), (576, 49152, True),
                                          (2048, 1000, True)])
def test_gemv_kernel_matches_twin(n, K, N, f32_out, rng):
    """kernels/gemv.cu for 1 to GEMV_MAX_ROWS rows (the engine sends it GEMV_DECODE_ROWS); out is a column slice
    of a wider buffer."""
    import cupy as cp

    from tinyvllm.model.backend import cuda_ops
    x32, x = bf16_pair(rng, (n, K))
    w32, w = bf16_pair(rng, (N, K), scale=K ** -0.5)
    wide = cp.full((n, N + 24), np.nan, np.float32) if f32_out else nan_bf16((n, N + 24))
    cuda_ops.gemv(x, w, wide[:, 8:8 + N])
    got = cp.asnumpy(wide) if f32_out else from_bf16(wide)
    assert np.isnan(got[:, :8]).all() and np.isnan(got[:, 8 + N:]).all(), "wrote outside its columns"
    expected = np.empty((n, N), np.float32)
    twin.gemm(x32, w32, expected)
    err = rel_err(got[:, 8:8 + N], expected)
    assert err < (1e-5 if f32_out else 1e-2), f"relative error {err:.2e}"
