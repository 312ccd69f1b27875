"""Chunked prefill on the GPU (chapter 7): a prompt prefilled chunk by chunk through the paged pool gives
the logits of one prefill (bf16 tolerance, argmax agreement measured), chunks after a prefix-cache hit
too; and the engine with a small step budget answers as with a big one."""
import pytest

from tests.chunking import chunked_logits
from tests.gpu_helpers import requires_gpu
from tests.numeric import rel_err
from tests.test_gpu_decode import gpu_model  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.mark.parametrize("chunks", [[1000], [333, 333, 334], [64, 936], [17, 500, 483]])
def test_chunked_logits_equal_one_prefill(gpu_model, chunks, rng):  # noqa: F811
    import cupy as cp
    _, model = gpu_model
    ids = rng.integers(0, model.cfg.vocab_size, 1000).tolist()
    whole = cp.asnumpy(chunked_logits(model, ids, [1000]))
    got = cp.asnumpy(chunked_logits(model, ids, chunks))
    agree = float((got.argmax(-1) == whole.argmax(-1)).mean())
    assert rel_err(got, whole) < 2e-2 and agree > 0.97, (rel_err(got, whole), agree)


def test_engine_with_a_small_budget_answers_as_with_a_big_one(gpu_model, rng):  # noqa: F811
    from tinyvllm import LLM, SamplingParams
    path, model = gpu_model
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (700, 33, 2000, 129)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for budget in (4096, 256):
        with LLM(str(path), device="cuda", max_num_batched_tokens=budget, long_prefill_token_threshold=budget,
                 num_blocks=600) as llm:   # the budget alone decides the chunks
            outs[budget] = [o.token_ids for o in llm.generate(prompts, params)]
            assert max(sum(t.chunks) + len(t.decode) for t in llm.engine.trace_since(0)) <= budget
    pairs = [(a, b) for x, y in zip(outs[4096], outs[256]) for a, b in zip(x, y)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    assert agree >= 0.9, f"{agree:.1%} of greedy tokens agree"   # bf16: chunk boundaries change sum orders
