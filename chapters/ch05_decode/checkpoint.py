"""`make chapter-5`: four prompts answered token by token — one prefill, then one decode step per token.

    make chapter-5                  # python -m chapters 5: on the GPU if CuPy sees one, else on the CPU
    make chapter-5 IMPL=student     # the same, with your decode_attention (Exercise 5.1) in the engine

The four answers live in one contiguous KV cache, one sequence each. Every step is timed until the
chosen token id is on the host, and its text is printed as soon as it is whole UTF-8. Then three checks:
  (a) teacher-forced parity: the logits of a prefill of t + 1 tokens equal those of a prefill of t
      tokens followed by one decode step (a RoPE position off by one would show here);
  (b) the greedy tokens equal chapter 1's NumPy reference model decoding with its own KV cache (on a
      GPU, bf16, the decode logits are compared with the reference's instead);
  (c) numpy_ops.decode_attention, on every layer's real query of check (a)'s decode step and the cache
      it read, equals reference.attention.
Engine functions are called through their modules, so the student's function, plugged into
tinyvllm.model.backend.numpy_ops by --impl student, is the one that runs.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from chapters.ch01_map import checkpoint as ch01
from chapters.ch01_map.checkpoint import Stage, rel_err, timed
from chapters.ch03_prefill.checkpoint import host_f32, print_table
from tinyvllm import reference
from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.model.sampler import sample
from tinyvllm.formats.config import LlamaConfig
from tinyvllm.formats.tokenizer import IncrementalDecoder, Tokenizer
from tinyvllm.model.backend import cuda_available, numpy_ops
from tinyvllm.model.decode import decode_step
from tinyvllm.model.kv_pool import ContiguousKVCache
from tinyvllm.model.model import Model
from tinyvllm.model.prefill import prefill

PROMPTS = ["What is 2+2?", "Name a color.", "Say hello.", "Capital of France?"]
MAX_NEW_TOKENS = 32
TOLERANCE = {"cpu": 1e-5, "cuda": 2e-2}  # relative error vs the float32 reference: f32 twins / bf16 kernels
EXERCISE_TOLERANCE = 1e-5                # Exercise 5.1 runs in NumPy float32 on either device
MAX_TOKENS = 256                         # the engine's buffers are planned for prompts up to this length
GREEDY = SamplingParams(temperature=0)


def kv_bytes_per_token(cfg: LlamaConfig, bytes_per_value: int) -> int:
    """K and V, every layer, every K/V head: what one more token of context costs (model/kv_pool.py)."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * bytes_per_value


# ---- generating: the loop LLM.stream runs, with every step timed ----

@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)    # the answer; ends with the stop token if one came
    text: str = ""
    prefill_s: float = 0.0                              # prefill + sampling the first token
    step_s: list[float] = field(default_factory=list)  # one decode step + sampling, per later token

    @property
    def tokens_per_s(self) -> float:
        return len(self.step_s) / sum(self.step_s) if self.step_s else 0.0


def stop_ids(tok: Tokenizer, cfg: LlamaConfig) -> set[int]:
    return set(tok.stop_token_ids) | set(cfg.eos_token_ids)


def generate(model: Model, tok: Tokenizer, ids: list[int], cache: ContiguousKVCache, seq: int,
             on_text=None, max_new_tokens: int = MAX_NEW_TOKENS) -> Generation:
    """Greedy: prefill `ids` into sequence `seq` of `cache`, then decode until a stop token or
    max_new_tokens; on_text(str) receives the text as soon as it is complete UTF-8."""
    gen, stops, decoder = Generation(list(ids)), stop_ids(tok, model.cfg), IncrementalDecoder(tok)
    rng = np.random.default_rng(0)  # greedy never draws from it
    start = time.perf_counter()
    logits, _ = prefill(model, ids, cache=cache, seq=seq)
    token = sample(logits, GREEDY, rng)  # the first answer token comes from the prefill's logits
    gen.prefill_s = time.perf_counter() - start
    while True:
        gen.tokens.append(token)
        if token in stops:
            break
        text = decoder.feed(token)
        gen.text += text
        if on_text and text:
            on_text(text)
        if len(gen.tokens) == max_new_tokens:
            break
        start = time.perf_counter()
        token = sample(decode_step(model, [token], cache, [seq])[0], GREEDY, rng)  # only the id reaches the host
        gen.step_s.append(time.perf_counter() - start)
    gen.text += decoder.flush()
    return gen


def warm_up(model: Model, ids: list[int]) -> float:
    """One prefill and two decode steps in a scratch cache: compiles the kernels on a GPU, wakes the
    BLAS threads on a CPU, so that the first prompt's times measure the work."""
    start, rng = time.perf_counter(), np.random.default_rng(0)
    cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=len(ids) + 2)
    logits, _ = prefill(model, ids, cache=cache)
    for _ in range(2):
        logits = decode_step(model, [sample(logits, GREEDY, rng)], cache, [0])[0]
    sample(logits, GREEDY, rng)  # the id on the host: the GPU has finished
    return time.perf_counter() - start


# ---- reading the queries that decode attention sees ----

class QueryRecorder:
    """Stands in for a backend module: passes every call through, and keeps a host float32 copy of the
    queries each decode_attention call reads, one (n, num_heads, head_dim) array per layer."""

    def __init__(self, ops):
        self._ops, self.queries = ops, []

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def decode_attention(self, qkv, k_cache, v_cache, starts, lengths, out, num_heads: int) -> None:
        head_dim = k_cache.shape[-1]
        q = host_f32(self._ops, qkv[:, :num_heads * head_dim])
        self.queries.append(q.reshape(len(q), num_heads, head_dim))
        self._ops.decode_attention(qkv, k_cache, v_cache, starts, lengths, out, num_heads)


@contextmanager
def recorded_queries(model: Model):
    """Inside the block, every decode step records each layer's queries in the yielded list."""
    recorder, original = QueryRecorder(model.ops), model.ops
    model.ops = recorder
    try:
        yield recorder.queries
    finally:
        model.ops = original


# ---- the checks ----

def check_parity(model: Model, ids: list[int], tol: float) -> tuple[Stage, ContiguousKVCache, list]:
    """(a) logits for the last token of `ids`: one prefill of all of them vs a prefill of all but the
    last + one decode step. Returns the stage, the decode step's cache and its per-layer queries."""
    t, start = len(ids) - 1, time.perf_counter()
    full = host_f32(model.ops, prefill(model, ids)[0])
    cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=t + 1)
    prefill(model, ids[:t], cache=cache)
    with recorded_queries(model) as queries:
        step = host_f32(model.ops, decode_step(model, [ids[t]], cache, [0])[0])
    err = rel_err(step, full)
    stage = Stage("(a) prefill(t+1) vs prefill(t) + decode", f"t = {t}, {step.shape} f32",
                  time.perf_counter() - start, f"rel err {err:.1e}", bool(err < tol))
    return stage, cache, queries


def check_greedy_tokens(m: ch01.Loaded, gen: Generation) -> Stage:
    """(b) on the CPU: the engine's greedy tokens are the reference model's, KV cache against KV cache."""
    ref, seconds = timed(ch01.generate, m.model, gen.prompt_ids, MAX_NEW_TOKENS, stop_ids(m.tok, m.cfg))
    ours, theirs = gen.tokens, ref["tokens"]
    differ = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    verdict = "identical" if ours == theirs else (f"differ from token {differ}" if differ is not None
                                                   else f"{len(theirs)} tokens, not {len(ours)}")
    return Stage("(b) greedy tokens vs reference", f"{len(ours)} tokens", seconds,
                 f"reference's KV-cache greedy: {verdict}", ours == theirs)


def engine_logits(model: Model, gen: Generation) -> np.ndarray:
    """The logits that picked each answer token, teacher-forced: prefill's, then one decode step per token."""
    cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=1, max_len=len(gen.prompt_ids) + len(gen.tokens))
    rows = [host_f32(model.ops, prefill(model, gen.prompt_ids, cache=cache)[0])]
    rows += [host_f32(model.ops, decode_step(model, [token], cache, [0])[0]) for token in gen.tokens[:-1]]
    return np.stack(rows)


def check_decode_logits(m: ch01.Loaded, model: Model, gen: Generation, tol: float) -> Stage:
    """(b) on the GPU: bf16 can flip a near tie, so compare each step's logits with the reference's."""
    start = time.perf_counter()
    ours = engine_logits(model, gen)
    theirs = m.model.forward(gen.prompt_ids + gen.tokens[:-1])[len(gen.prompt_ids) - 1:]  # one reference pass
    errors = [rel_err(a, b) for a, b in zip(ours, theirs)]
    agree = np.mean(ours.argmax(-1) == theirs.argmax(-1))
    return Stage("(b) decode logits vs reference", f"{len(ours)} steps", time.perf_counter() - start,
                 f"max rel err {np.max(errors):.1e}, argmax agreement {agree:.0%}", bool(np.max(errors) < tol))


def check_exercise(model: Model, cache: ContiguousKVCache, queries: list[np.ndarray]) -> Stage:
    """(c) Exercise 5.1 on the real cache: each layer's new query against its L cached keys."""
    start, errors = time.perf_counter(), []
    L, H = cache.lengths[0], model.cfg.num_attention_heads
    starts, lengths = np.array([0], np.int32), np.array([L], np.int32)
    for i, q in enumerate(queries):
        k, v = (host_f32(model.ops, a) for a in cache.view(0, i))  # (L, kv_heads, head_dim), f32
        out = np.full((1, q[0].size), np.nan, np.float32)
        numpy_ops.decode_attention(q.reshape(1, -1), k, v, starts, lengths, out, H)  # through the module
        errors.append(rel_err(out[0], reference.attention(q, k, v, start_pos=L - 1)[0]))
    worst = np.max(errors)  # np.max, not max(): a NaN must win
    return Stage("(c) decode_attention (Ex. 5.1)", f"{len(queries)} layers x {L} keys", time.perf_counter() - start,
                 f"max rel err {worst:.1e} vs reference.attention", bool(worst < EXERCISE_TOLERANCE))


# ---- the run ----

def stream_to_terminal(text: str) -> None:
    print(text.replace("\n", "\n  "), end="", flush=True)  # the answer indented under its prompt


def answer_all(model: Model, tok: Tokenizer, prompts: list[list[int]]) -> tuple[list[Generation], ContiguousKVCache]:
    """Each prompt into its own sequence of one cache, answered and streamed to the terminal."""
    cache = ContiguousKVCache(model.cfg, model.ops, num_seqs=len(prompts),
                              max_len=max(len(ids) for ids in prompts) + MAX_NEW_TOKENS)
    gens = []
    for seq, (text, ids) in enumerate(zip(PROMPTS, prompts)):
        first_slot = seq * cache.max_len
        print(f"[sequence {seq}, slots {first_slot}..{first_slot + cache.max_len - 1}] {text}  "
              f"({len(ids)} prompt tokens)\n  ", end="")
        gen = generate(model, tok, ids, cache, seq, on_text=stream_to_terminal)
        steps = gen.step_s or [float("nan")]
        print(f"\n  prefill {gen.prefill_s * 1e3:.1f} ms; {len(gen.step_s)} decode steps: median "
              f"{statistics.median(steps) * 1e3:.1f} ms (min {min(steps) * 1e3:.1f}, max {max(steps) * 1e3:.1f}) "
              f"-> {gen.tokens_per_s:.1f} tokens/s\n")
        gens.append(gen)
    return gens, cache


def main() -> bool:
    device = "cuda" if cuda_available() else "cpu"
    m, load_s = timed(ch01.load)  # tokenizer + the float32 reference model
    cfg, tol = m.cfg, TOLERANCE[device]
    model, build_s = timed(Model, m.model_dir, device, MAX_TOKENS)
    prompts = [m.tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    width = 4 if device == "cpu" else 2
    print(f"model: {m.model_dir} ({cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} K/V heads x "
          f"{cfg.head_dim})\ndevice: {device}; greedy, chat template, at most {MAX_NEW_TOKENS} new tokens\n"
          f"KV cache: 2 x {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} heads x {cfg.head_dim} x "
          f"{width} bytes = {kv_bytes_per_token(cfg, width):,} bytes per token\n"
          f"warm-up (one prefill, two decode steps): {warm_up(model, prompts[0]) * 1e3:.0f} ms\n")

    gens, cache = answer_all(model, m.tok, prompts)
    steps = [s for g in gens for s in g.step_s]
    held = [cache.lengths[seq] for seq in range(cache.num_seqs)]
    print(f"the cache: {cache.num_seqs} sequences x {cache.max_len} slots, holding {held} tokens; "
          f"{cache.nbytes / 1e6:.1f} MB allocated")

    first = gens[0]
    parity, parity_cache, queries = check_parity(model, first.prompt_ids + first.tokens, tol)
    stages = [Stage("load the reference", "tokenizer + f32 weights", load_s),
              Stage(f"engine Model on {device}", f"{sum(r.nbytes for r in model.weight_regions) / 1e6:.0f} MB "
                    f"of {'bf16' if device == 'cuda' else 'f32'} weights", build_s),
              parity,
              check_greedy_tokens(m, first) if device == "cpu" else check_decode_logits(m, model, first, tol),
              check_exercise(model, parity_cache, queries)]
    print(f"\nchecks on {PROMPTS[0]!r} and its answer (tolerance {tol:g} relative):\n")
    print_table(stages)
    print(f"\ndecode on {device}: {len(steps)} steps, median {statistics.median(steps) * 1e3:.1f} ms per token "
          f"({1 / statistics.median(steps):.1f} tokens/s); prefill median "
          f"{statistics.median(g.prefill_s for g in gens) * 1e3:.1f} ms")
    ok = all(s.ok is not False for s in stages)
    print("checkpoint 5:", "PASSED" if ok else "FAILED")
    return ok
