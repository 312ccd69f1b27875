"""`make chapter-10`: the default model answers greedily with speculation off and on; the tokens must be the same.

    make chapter-10                 # python -m chapters 10: on the CPU, whatever the machine
    make chapter-10 IMPL=student    # the same, with your propose_ngram, accept_greedy and rollback_block_table
                                    # inside the engine, and your rejection_sample under the statistical test

One LLM on the CPU (prompt lookup, k = 4 guesses a step). Each prompt runs twice: once with the scheduler's
proposer taken away (plain decoding, one token a step) and once with it. Then the checks:
  (a) every prompt's greedy tokens identical with and without speculation;
  (b) the grounded prompt (the answer repeats the prompt) needs fewer engine steps with speculation;
  (c) every block given back: once the requests finish, the pool's free blocks are what they were before;
  (d) rejection sampling (10.3): 20,000 positions with the model's own next-token distribution as the target
      p and a flattened copy of it as the draft q: the emitted tokens pass a chi-square test against p, and
      the share of guesses kept is sum(min(p, q)).
The engine calls the functions of chapters/ch10_speculative/speculative.py through plug_into(), looked up at
each call, so with --impl student yours run.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from chapters.ch01_map.checkpoint import Stage
from chapters.ch03_prefill.checkpoint import print_table
from chapters.ch10_speculative import speculative
from tinyvllm import LLM, SamplingParams
from tinyvllm.model import sampler

K = 4
MAX_TOKENS = 40
PARAGRAPH = ("The paged KV cache splits the memory of every sequence into blocks of sixteen tokens. A block "
             "table maps the logical blocks of a sequence to physical blocks in one shared pool.")
PROMPTS = {   # the first two of bench/spec_decode.py's workloads, shortened
    "grounded": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "free-form": "Explain why the sky is blue to a ten-year-old.",
}
DRAWS = 20_000
SIGNIFICANCE = 1e-4   # a right rule fails the chi-square test this rarely; a wrong one scores near 0


class CourseProposer:
    """The scheduler's proposer, through speculative.propose_ngram (yours with --impl student)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq, k: int) -> list[int]:
        return speculative.propose_ngram(list(seq.token_ids), k, self.min_n, self.max_n)


def course_verify(target, proposals: list[int]) -> list[int]:
    """sampler.verify for greedy requests: the target's token at every position, then speculative.accept_greedy.
    (Greedy only: a sampled request draws position by position, each draw after the tokens kept before it.)"""
    return speculative.accept_greedy(list(proposals), [target(j, []) for j in range(len(proposals) + 1)])


def plug_into(llm: LLM) -> None:
    """Route the engine's proposer, greedy acceptance and KV rollback through speculative.py."""
    scheduler = llm.engine.scheduler
    config = llm.engine.config
    scheduler.proposer = CourseProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    sampler.verify = course_verify
    manager = scheduler.block_manager

    def truncate(seq: int, num_tokens: int) -> None:
        table, length = manager.tables[seq], manager.lengths[seq]
        new, freed = speculative.rollback_block_table(list(table), length, length - num_tokens)
        for block in freed:
            manager._release(block)
        table[:] = new              # in place: a step plan may hold this very list
        manager.lengths[seq] = num_tokens

    manager.truncate = truncate


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    steps: int
    emitted: Counter = field(default_factory=Counter)   # tokens per verification -> how many verifications
    proposed: int = 0
    accepted: int = 0


def run(llm: LLM, prompt: str, speculate: bool, max_tokens: int = MAX_TOKENS) -> Run:
    """One chat prompt, greedy, alone; with or without the proposer. Counts the engine's steps and what each
    verification emitted."""
    engine, scheduler = llm.engine, llm.engine.scheduler
    proposer, stats = scheduler.proposer, engine.spec_stats
    if not speculate:
        scheduler.proposer = None
    record, steps, emitted = stats.add, [0], Counter()
    before = (stats.proposed, stats.accepted)

    def counting_add(proposed: int, tokens: int) -> None:
        emitted[tokens] += 1
        record(proposed, tokens)

    def counting_step(step=engine.step):
        steps[0] += 1
        return step()

    stats.add, engine.step = counting_add, counting_step
    try:
        start = time.perf_counter()
        [out] = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens))
        seconds = time.perf_counter() - start
    finally:
        scheduler.proposer = proposer
        del stats.add, engine.step   # the instance attributes go: the class's methods again
    return Run(list(out.outputs[0].token_ids), seconds, steps[0], emitted,
               stats.proposed - before[0], stats.accepted - before[1])


def draft_and_target(llm: LLM, prompt: str, top: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """p: the model's next-token distribution after the prompt (temperature 1), on its `top` likeliest tokens
    renormalized (a vocabulary of 49,152 would need millions of draws to test); q: p flattened, a worse guesser."""
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=top))[0].outputs[0]
    logprobs = np.array(sorted((lp.logprob for lp in out.logprobs[0].values()), reverse=True)[:top])
    p = np.exp(logprobs - logprobs.max())
    p /= p.sum()
    q = np.sqrt(p)
    return p, q / q.sum()


def check_rejection(p: np.ndarray, q: np.ndarray) -> Stage:
    start = time.perf_counter()
    counts, kept = speculative.draw_many(speculative.rejection_sample, p, q, DRAWS, seed=10)
    seconds = time.perf_counter() - start
    p_value = speculative.chi_square_p_value(counts, p)
    expected_kept = float(np.minimum(p, q).sum())
    sigma = np.sqrt(DRAWS * expected_kept * (1 - expected_kept))
    kept_ok = abs(kept - DRAWS * expected_kept) < 5 * sigma
    return Stage(f"(d) rejection sampling, {len(p)} tokens", f"{DRAWS:,} draws", seconds,
                 f"chi-square p = {p_value:.2f} (> {SIGNIFICANCE:g}); kept {kept / DRAWS:.1%}, sum(min(p, q)) = "
                 f"{expected_kept:.1%}", bool(p_value > SIGNIFICANCE and kept_ok))


def main() -> bool:
    which = "yours" if speculative.propose_ngram.__module__.startswith("chapters.ch10_speculative.exercises") \
        else "the engine's"
    start = time.perf_counter()
    llm = LLM("default", device="cpu", speculative_method="ngram", num_speculative_tokens=K)
    stages = [Stage("LLM('default', device='cpu')", f"speculation: ngram, k = {K}", time.perf_counter() - start)]
    plug_into(llm)
    manager = llm.engine.scheduler.block_manager
    free_before = manager.num_free
    tok = llm.tokenizer
    print(f"model: {llm.engine.config.model} on the CPU; prompt lookup n = {llm.engine.config.prompt_lookup_max} "
          f"down to {llm.engine.config.prompt_lookup_min}, k = {K}; the functions of speculative.py: {which}\n")
    run(llm, "Hello", False, 2)   # warm-up: the first call pays for buffers and BLAS threads
    for name, prompt in PROMPTS.items():
        off, on = run(llm, prompt, False), run(llm, prompt, True)
        verifications = sum(on.emitted.values())
        print(f"{name}: {prompt[:60]!r}...\n  off: {off.steps} steps, {len(off.tokens)} tokens, {off.seconds:.2f} s "
              f"-> {tok.decode(off.tokens)[:70]!r}\n  on:  {on.steps} steps, {len(on.tokens)} tokens, {on.seconds:.2f} s;"
              f" {verifications} verifications, {on.proposed} proposed, {on.accepted} accepted "
              f"({on.accepted / max(on.proposed, 1):.0%}), {1 + on.accepted / max(verifications, 1):.2f} tokens per "
              f"verification\n  tokens per verification: "
              f"{', '.join(f'{n}: {c}' for n, c in sorted(on.emitted.items())) or 'none'}\n")
        same = on.tokens == off.tokens
        first = next((i for i, (a, b) in enumerate(zip(on.tokens, off.tokens)) if a != b), None)
        stages.append(Stage(f"(a) {name}, greedy, off vs on", f"{len(on.tokens)} tokens", on.seconds,
                            "identical tokens" if same else f"differ from token {first}", same))
        if name == "grounded":
            stages.append(Stage(f"(b) {name}: engine steps", f"{off.steps} off, {on.steps} on", 0.0,
                                f"x{off.steps / on.steps:.2f} fewer steps; time x{off.seconds / on.seconds:.2f}",
                                on.steps < off.steps))
    stages.append(Stage("(c) blocks after the requests", f"{manager.num_free} free", 0.0,
                        f"{free_before} before", manager.num_free == free_before))
    p, q = draft_and_target(llm, PROMPTS["free-form"])
    stages.append(check_rejection(p, q))
    llm.close()
    print_table(stages)
    ok = all(s.ok is not False for s in stages)
    print("checkpoint 10:", "PASSED" if ok else "FAILED")
    return ok
