"""Speculative decoding in the batch-invariant mode: the same tokens and logprobs as plain decoding, bit for bit?

The six prompts of bench/spec_decode.py (grounded and free-form) run greedily (96 tokens, 2 logprobs) in one
batch through LLM(batch_invariant=True), once without speculation and once with prompt lookup (k = 4); per
prompt, whether the token ids and every logprob are identical. On a GPU this is the check that a verification
(k + 1 decode rows from the CUDA graph of that many rows) computes each position as plain decoding does.
Writes bench/results/spec-invariant-<device>-<time>.json.

    python bench/spec_invariance.py [--device cuda] [--model default]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from bench.gpu_common import write_result  # noqa: E402
from bench.spec_decode import WORKLOADS  # noqa: E402
from tinyvllm import LLM, SamplingParams  # noqa: E402
from tinyvllm.model.backend import resolve_device  # noqa: E402

SPECULATION = {"method": "ngram", "num_speculative_tokens": 4}


def answers(model: str, device: str, speculative_config: dict | None) -> list:
    llm = LLM(model, device=device, batch_invariant=True, gpu_memory_utilization=0.3,
              **({"speculative_config": speculative_config} if speculative_config else {}))
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
               for p in WORKLOADS["grounded"] + WORKLOADS["free-form"]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=96, logprobs=2), use_tqdm=False)
    llm.close()
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    plain, speculating = answers(args.model, args.device, None), answers(args.model, args.device, SPECULATION)
    same = [a == b for a, b in zip(plain, speculating)]
    print("batch-invariant mode, speculation on vs off, same tokens and logprobs:", same)
    write_result(f"spec-invariant-{resolve_device(args.device)}", {"benchmark": "spec_invariance", "model": args.model,
                                                   "speculative_config": SPECULATION, "same": same})


if __name__ == "__main__":
    main()
