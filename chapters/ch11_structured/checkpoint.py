"""`make chapter-11`: the default model on the CPU, sampling at temperature > 0 under a JSON schema and a regex.

    make chapter-11                  # python -m chapters 11: on the CPU, whatever the machine
    make chapter-11 IMPL=student     # the same, the engine running your compile_dfa (11.1), token_states (11.2)
                                     # and schema_tree (11.3)

The program asks the model, in one batch, for SEEDS replies under a JSON schema (an object with required and
optional properties of the types of Exercise 11.3) and SEEDS replies under a regex, each sampled at TEMPERATURE
with its own seed, plus one greedy reply of each. Then the checks:
  (a) every reply under the schema is JSON that validates against it (the jsonschema library);
  (b) every reply under the regex matches it whole (re.fullmatch);
  (c) every reply ended because it was complete ("stop"), not because it ran out of tokens;
  (d) every sampled token's logprob is finite: the logprobs are those of the masked distribution.
The engine compiles each constraint once (compiler.compile_dfa, params.schema_tree) and computes a state's token
mask the first time a sequence reaches it (token_dfa.token_states), so with --impl student yours run.
"""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np

from chapters.ch01_map.checkpoint import Stage, timed
from chapters.ch03_prefill.checkpoint import print_table
from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.engine.structured import compiler
from tinyvllm.engine.structured.params import StructuredOutputsParams
from tinyvllm.entrypoints.llm import LLM

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer"},
                         "capital": {"type": "boolean"}, "river": {"type": "string", "maxLength": 24}},
          "required": ["city", "population", "capital"]}
REGEX = r"(yes|no), because [a-z ,]{1,60}\."
PROMPTS = {
    "json": f"Give one French city as JSON with the keys city, population, capital and river. Schema: {json.dumps(SCHEMA)}",
    "regex": "Is Paris the capital of France? Answer yes or no, then give the reason in a few lowercase words.",
}
SEEDS = 4
TEMPERATURE = 0.8
MAX_TOKENS = 64


def validates(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def requests() -> list[tuple[str, str, SamplingParams]]:
    """(kind, prompt, params): SEEDS sampled replies and one greedy reply per constraint."""
    out = []
    for kind, constraint in (("json", StructuredOutputsParams(json=SCHEMA)), ("regex", StructuredOutputsParams(regex=REGEX))):
        for seed in [*range(SEEDS), None]:
            temperature = 0.0 if seed is None else TEMPERATURE
            out.append((kind, PROMPTS[kind], SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                                                            logprobs=1, structured_outputs=constraint)))
    return out


def main() -> bool:
    llm, load_s = timed(lambda: LLM("default", device="cpu"))
    which = "yours" if compiler.compile_dfa.__module__.startswith("chapters") else "the engine's"
    print(f"model: {llm.model_dir} on the CPU; "
          f"compile_dfa, token_states, schema_tree: {which}")
    print(f"schema: {json.dumps(SCHEMA)}\nregex:  {REGEX}\n")
    batch = requests()
    outputs, seconds = timed(llm.chat, [[{"role": "user", "content": p}] for _, p, _ in batch], [r for _, _, r in batch])
    tokens = sum(len(o.token_ids) for o in outputs)
    stages = [Stage("LLM('default', device='cpu')", "", load_s),
              Stage(f"{len(batch)} replies in one batch", f"{tokens} tokens", seconds)]
    checks = {"json": (validates, "(a) valid JSON for the schema"), "regex": (lambda t: bool(re.fullmatch(REGEX, t)),
                                                                           "(b) re.fullmatch of the regex")}
    for kind in ("json", "regex"):
        check, name = checks[kind]
        mine = [(r, o) for (k, _, r), o in zip(batch, outputs) if k == kind]
        for params, out in mine:
            how = "greedy " if params.temperature == 0 else f"seed {params.seed}"
            print(f"  {kind:5} {how:7} {'ok  ' if check(out.text) else 'FAIL'} {out.text!r}")
        good = sum(check(o.text) for _, o in mine)
        stages.append(Stage(name, f"{good} of {len(mine)}", 0.0, f"temperature {TEMPERATURE} x {SEEDS} seeds + greedy",
                            good == len(mine)))
    print()
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in outputs)
    stages.append(Stage("(c) ended complete", f"{stopped} of {len(outputs)}", 0.0, 'finish_reason "stop"',
                        stopped == len(outputs)))
    finite = all(np.isfinite(entry[t].logprob) for o in outputs for t, entry in zip(o.token_ids, o.outputs[0].logprobs))
    stages.append(Stage("(d) logprobs of the masked distribution", "finite" if finite else "-inf found", 0.0,
                        "every sampled token's logprob", finite))
    cached = list(llm.engine.structured._compiled.values())
    for token_dfa in cached:
        print(f"  automaton: {token_dfa.dfa.num_states} DFA states, {len(token_dfa._masks)} token masks computed "
              f"(one per state reached) over {token_dfa.vocab.size:,} tokens")
    print()
    print_table(stages)
    ok = all(s.ok is not False for s in stages)
    print("checkpoint 11:", "PASSED" if ok else "FAILED")
    return ok
