"""An LLM's memory lifecycle: close() and `with LLM(...) as llm:` free the model, the buffers, the KV cache
pool and the CUDA graphs at once; a closed LLM refuses work with one line; a second LLM in the same process
works after close() and, on the GPU, after a plain `del` too (CuPy's cached memory counts as free)."""
from __future__ import annotations

import weakref

import pytest

from tests.gpu_helpers import requires_gpu
from tinyvllm import LLM, SamplingParams, TinyVLLMError
from tinyvllm.formats.checkpoints import synth_model

TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128)
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 140))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(synth_model("llama-3.2-1b", tmp_path_factory.mktemp("lifecycle") / "tiny", seed=5, **TINY))


def cpu_llm(model_dir: str) -> LLM:
    return LLM(model_dir, device="cpu", num_blocks=64)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_close_frees_the_arrays_and_a_second_llm_works(model_dir):
    first = cpu_llm(model_dir)
    expected = greedy_tokens(first)
    held = [first.model, first.engine.pool, first.engine, first.engine.pool.k, first.model.buffers["residual"]]
    refs = [weakref.ref(x) for x in held]
    del held
    first.close()
    assert [r() for r in refs] == [None] * len(refs), "something still holds the closed LLM's model or pool"
    second = cpu_llm(model_dir)
    assert greedy_tokens(second) == expected


def one_line_error(call) -> str:
    with pytest.raises(TinyVLLMError) as e:
        call()
    message = str(e.value)
    assert "closed" in message and "\n" not in message
    return message


def test_a_closed_llm_refuses_work_with_one_line(model_dir):
    llm = cpu_llm(model_dir)
    llm.close()
    llm.close()  # twice is harmless
    one_line_error(lambda: llm.generate("hello", GREEDY))
    one_line_error(lambda: llm.generate(PROMPTS, GREEDY))
    one_line_error(lambda: llm.chat([{"role": "user", "content": "hi"}], GREEDY))
    one_line_error(lambda: llm.add_request(PROMPTS[0], GREEDY))
    one_line_error(lambda: next(llm.stream(PROMPTS[0], GREEDY)))


def test_close_between_stream_chunks_ends_the_stream(model_dir):
    llm = cpu_llm(model_dir)
    chunks = llm.stream(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert isinstance(next(chunks), str)
    llm.close()
    one_line_error(lambda: next(chunks))


def test_with_block_closes_the_llm(model_dir):
    with cpu_llm(model_dir) as llm:
        expected = greedy_tokens(llm)
    one_line_error(lambda: llm.generate(PROMPTS, GREEDY))
    with pytest.raises(ValueError), cpu_llm(model_dir) as failing:  # an error inside the block: closed too,
        raise ValueError("the block failed")                        # and the error is not swallowed
    one_line_error(lambda: failing.generate(PROMPTS, GREEDY))
    with cpu_llm(model_dir) as again:
        assert greedy_tokens(again) == expected


# ---- on the GPU: the memory goes back, and the pool of a second LLM is as large as the first's ----------

@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    from tests.test_gpu_prefill import CONFIGS, save_random_llama_with_tokenizer
    return str(save_random_llama_with_tokenizer(tmp_path_factory.mktemp("lifecycle_gpu"), CONFIGS["tiny-gqa4"], seed=3))


# Half the GPU: the first LLM's pool takes what is left of it, so a second one finds room only if the first's
# memory is counted as free, and cudaMalloc still has the other half (no test of CuPy's fragmentation)
UTILIZATION = 0.5


def gpu_llm(path: str) -> LLM:
    return LLM(path, device="cuda", gpu_memory_utilization=UTILIZATION)


@pytest.mark.gpu
@requires_gpu
def test_gpu_second_llm_after_close(gpu_model_dir):
    import cupy as cp
    free_before = cp.cuda.runtime.memGetInfo()[0]
    first = gpu_llm(gpu_model_dir)
    expected, blocks = greedy_tokens(first), first.engine.pool.num_blocks
    first.close()
    free_after = cp.cuda.runtime.memGetInfo()[0]
    # back to the driver, not only to CuPy's pool; what stays is compiled kernels, cuBLAS's workspace and
    # the split-attention workspace, all per process
    assert free_after >= free_before - 2**28, f"{(free_before - free_after) / 2**20:.0f} MiB still held"
    with gpu_llm(gpu_model_dir) as second:
        assert second.engine.pool.num_blocks >= 0.99 * blocks, (second.engine.pool.num_blocks, blocks)
        assert greedy_tokens(second) == expected


@pytest.mark.gpu
@requires_gpu
def test_gpu_second_llm_after_del_without_close(gpu_model_dir):
    first = gpu_llm(gpu_model_dir)
    expected, blocks = greedy_tokens(first), first.engine.pool.num_blocks
    del first  # its memory stays in CuPy's pool: the second LLM's pool sizing must count it as free
    with gpu_llm(gpu_model_dir) as second:
        assert second.engine.pool.num_blocks >= 0.99 * blocks, (second.engine.pool.num_blocks, blocks)
        assert greedy_tokens(second) == expected
