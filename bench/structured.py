"""Structured outputs on the CPU: what a constraint costs per sequence per step once its masks are cached.

For each constraint, an adversarial writer (uniform over the allowed tokens) walks the default model's
vocabulary through the token automaton until the output is complete, twice: the first walks compute the
masks of the states they meet (the one-time cost), the second walk replays the same
tokens with every mask cached and times, per token, what the engine does each step: the matcher's advance
and its next mask (Sequence._follow), and the sampler putting -inf on the forbidden logits (apply_masks).
A recursive schema (a tree whose children are trees) runs on the pushdown automaton, whose masks are cached
per top-of-stack state and per parser state: its uniform walks stay shallow, so it also replays a tree nested
DEEP levels deep, as the tokenizer splits it (the "deep tree" row). Writes bench/results/structured-<time>.json.

    python bench/structured.py [--walks 20]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from bench.gpu_common import write_result  # noqa: E402
from tinyvllm import SamplingParams, StructuredOutputsParams  # noqa: E402
from tinyvllm.engine.structured.compiler import StructuredOutputCompiler  # noqa: E402
from tinyvllm.engine.structured.token_dfa import Matcher  # noqa: E402
from tinyvllm.formats.checkpoints import default_model_dir  # noqa: E402
from tinyvllm.formats.config import load_config  # noqa: E402
from tinyvllm.formats.tokenizer import load_tokenizer  # noqa: E402
from tinyvllm.model.sampler import apply_masks  # noqa: E402
from tinyvllm.model.step_plan import Sampling  # noqa: E402

EOS = 2   # SmolLM2's <|im_end|>
CONSTRAINTS = {
    "json schema": StructuredOutputsParams(json={
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}},
        "required": ["name", "age"]}),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{1,10}( [A-Z][a-z]{1,10}){0,3}\."),
    "recursive": StructuredOutputsParams(json={
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["name", "children"]}),
}
DEEP = 12                 # the replayed tree's levels of nesting


def deep_tree(depth: int) -> dict:
    """A tree for the recursive schema: two children per node down to `depth`, leaves at the bottom."""
    children = [deep_tree(depth - 1), {"name": "leaf", "children": []}] if depth else []
    return {"name": f"level {depth}", "children": children}


def walk(compiler: StructuredOutputCompiler, params: StructuredOutputsParams, rng, steps: int) -> list[int]:
    """Tokens an adversarial writer picks, uniform over each step's allowed tokens (EOS when the output may end)."""
    matcher, tokens = Matcher(compiler.compile(params), {EOS}), []
    for _ in range(steps):
        allowed = matcher.allowed()
        token = EOS if allowed[EOS] else int(rng.choice(np.flatnonzero(allowed)))
        if token == EOS:
            break
        matcher.advance(token)
        tokens.append(token)
        if matcher.must_stop():
            break
    return tokens


def per_step_seconds(compiler, params, tokens: list[int], logits: np.ndarray) -> tuple[float, float]:
    """Replay the tokens with warm caches: (advance + next mask, the sampler's masking of one logits row), per step."""
    matcher = Matcher(compiler.compile(params), {EOS})
    start = time.perf_counter()
    for token in tokens:
        matcher.advance(token)
        if not matcher.must_stop():
            matcher.allowed()
    follow = (time.perf_counter() - start) / len(tokens)
    sampling = [Sampling(SamplingParams(), np.random.default_rng(0), [], [], matcher.allowed() if not matcher.must_stop()
                         else np.ones(logits.shape[1], dtype=bool))]
    start = time.perf_counter()
    for _ in range(len(tokens)):
        apply_masks(logits, sampling, [0])
    return follow, (time.perf_counter() - start) / len(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300, help="tokens per walk at most")
    args = parser.parse_args()
    model_dir = default_model_dir()
    vocab_size = load_config(model_dir).vocab_size
    tokenizer = load_tokenizer(model_dir)
    compiler = StructuredOutputCompiler(tokenizer.token_bytes, vocab_size)
    start = time.perf_counter()
    compiler.vocab
    results = {"vocabulary_trie_s": time.perf_counter() - start, "constraints": {}}
    logits = np.random.default_rng(0).standard_normal((1, vocab_size)).astype(np.float32)
    print(f"vocabulary trie: {results['vocabulary_trie_s']:.2f} s ({len(compiler.vocab.parent)} nodes)")
    workloads = [(name, params, None) for name, params in CONSTRAINTS.items()]
    workloads.append(("deep tree", CONSTRAINTS["recursive"], tokenizer.encode(json.dumps(deep_tree(DEEP)))))
    for name, params, replay in workloads:
        rng = np.random.default_rng(0)
        start = time.perf_counter()
        token_dfa = compiler.compile(params)
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        walks = [replay] if replay else [walk(compiler, params, rng, args.steps) for _ in range(args.walks)]
        if replay:                                     # its first pass computes the masks it meets
            per_step_seconds(compiler, params, replay, logits)
        first_s, states = time.perf_counter() - start, len(token_dfa._masks)
        timings = [per_step_seconds(compiler, params, tokens, logits) for tokens in walks if tokens]
        follow_us = 1e6 * statistics.median(t[0] for t in timings)
        mask_us = 1e6 * statistics.median(t[1] for t in timings)
        results["constraints"][name] = {"automaton_states": token_dfa.num_states, "compile_s": compile_s,
                                        "masks_computed": states, "first_walks_s": first_s,
                                        "follow_us_per_step": follow_us, "apply_mask_us_per_step": mask_us}
        print(f"{name:12s} {token_dfa.num_states:5d} states ({type(token_dfa).__name__}), compiled in {compile_s:.2f} s; "
              f"first walks {first_s:.2f} s ({states} masks computed); per step with the masks "
              f"cached: advance + next mask {follow_us:.1f} us, -inf on the logits row {mask_us:.1f} us")
    results["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "python": platform.python_version(), "numpy": np.__version__}
    write_result("structured", results)


if __name__ == "__main__":
    main()
