"""Chapter 8, last section, on the CPU: the persistent decode step's instruction list (model/persistent.py) and its
NumPy twin (numpy_ops.decode_persistent, which runs the list in order).

- the list is the fused layer, op for op: embedding, then per layer rms_norm_gemv, rope_store_kv, paged_attention,
  gemv_add, rms_norm_gemv_swiglu, gemv_add, then the final rms_norm_gemv into the logits — and its arguments are the
  step's own buffers (a CUDA graph replays their addresses);
- running it gives the fused layer's bits: logits and the K/V pool, 1 to GEMV_MAX_ROWS rows, several steps, the
  step buffers NaN-poisoned before each (an instruction reading a buffer nobody wrote this step shows as NaN);
- a list with an instruction missing does not give those bits (the comparison can fail).
The GPU kernel that runs the same list (kernels/decode_persistent.cu) is tested in tests/test_gpu_persistent.py.
"""
import numpy as np
import pytest

from tests.test_fused_decode import poison, same_bits
from tinyvllm.model.backend.constants import GEMV_MAX_ROWS


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from tinyvllm.model.model import Model
    return Model(tiny_llama_dir, device="cpu", max_num_batched_tokens=256)


def prefilled(model, rng, n: int):
    """Two pools holding the same n prefilled prompts (one per way of decoding), with their block managers."""
    from tinyvllm.engine.block_manager import BlockManager, plan_prefill
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.prefill import prefill_batch
    longest = min(40, model.max_num_batched_tokens // n)
    prompts = [rng.integers(0, model.cfg.vocab_size, int(rng.integers(1, longest + 1))).tolist() for _ in range(n)]
    runs = []
    for _ in range(2):
        blocks, pool = BlockManager(n * 8), PagedKVPool(model.cfg, model.ops, n * 8)
        prefill_batch(model, pool, [plan_prefill(blocks, s, p) for s, p in enumerate(prompts)])
        runs.append((blocks, pool))
    return runs


def program_of(model, pool, plan):
    """The step's instruction list over fresh input arrays, and the logits array it writes."""
    from tinyvllm.model.persistent import build_program
    from tinyvllm.model.step_plan import step_inputs
    ids, positions, slots = (np.asarray(c, dtype=np.int32) for c in step_inputs(plan))
    tables, lengths = pool.where(plan, [s.end for s in plan])
    logits = np.full((len(plan), model.cfg.vocab_size), np.nan, np.float32)
    return build_program(model, ids, positions, slots, pool, tables, lengths, logits), logits


def test_the_list_is_the_fused_layer_op_for_op(model, rng):
    from tinyvllm.engine.block_manager import plan_decode
    (blocks, pool), _ = prefilled(model, rng, 2)
    program, logits = program_of(model, pool, plan_decode(blocks, [0, 1], [5, 7]))
    layer = ["rms_norm_gemv", "rope_store_kv", "paged_attention", "gemv_add", "rms_norm_gemv_swiglu", "gemv_add"]
    assert [name for name, _ in program] == (["embedding"] + layer * model.cfg.num_hidden_layers + ["rms_norm_gemv"])
    assert program[-1][1][3] is logits, "the last instruction writes the step's logits"
    assert program[-1][1][2] is model.lm_head and program[1][1][2] is model.layers[0].qkv


@pytest.mark.parametrize("n", range(1, GEMV_MAX_ROWS + 1))
def test_the_twin_gives_the_fused_layer_bits(model, rng, n, monkeypatch):
    from tinyvllm.engine.block_manager import plan_decode
    from tinyvllm.model import decode
    from tinyvllm.model.decode import decode_batch
    from tinyvllm.model.persistent import decode_persistent
    monkeypatch.setattr(decode, "GEMV_DECODE_ROWS", GEMV_MAX_ROWS)   # the fused layer for every n the list takes
    (blocks, pool), (fused_blocks, fused_pool) = prefilled(model, rng, n)
    for step in range(3):
        tokens = rng.integers(0, model.cfg.vocab_size, n).tolist()
        poison(model)
        want = decode_batch(model, fused_pool, plan_decode(fused_blocks, list(range(n)), tokens)).copy()
        program, got = program_of(model, pool, plan_decode(blocks, list(range(n)), tokens))
        poison(model)
        decode_persistent(model, program)
        same_bits(got, want, f"the logits of {n} sequences at step {step}")
        same_bits(pool.k, fused_pool.k, "the K pool")
        same_bits(pool.v, fused_pool.v, "the V pool")


def test_a_list_missing_an_instruction_gives_other_logits(model, rng, monkeypatch):
    from tinyvllm.engine.block_manager import plan_decode
    from tinyvllm.model import decode
    from tinyvllm.model.decode import decode_batch
    from tinyvllm.model.persistent import decode_persistent
    monkeypatch.setattr(decode, "GEMV_DECODE_ROWS", GEMV_MAX_ROWS)
    (blocks, pool), (fused_blocks, fused_pool) = prefilled(model, rng, 1)
    want = decode_batch(model, fused_pool, plan_decode(fused_blocks, [0], [3])).copy()
    program, got = program_of(model, pool, plan_decode(blocks, [0], [3]))
    down = max(i for i, (name, _) in enumerate(program) if name == "gemv_add")   # the last layer's down projection
    decode_persistent(model, program[:down] + program[down + 1:])
    assert not np.array_equal(got, want), "without the last down projection the logits must change"
