"""Plausible wrong answers to the exercises, each of which the graders once passed, and correct answers
written another way, which they once failed. tests/test_graders_fail_on_stubs.py grades each one.

`python -m tests.mutants DIR` grades each one as the student's answer (the chapter's exercises.py made of
the engine's reference functions with the entry's functions in their place), running only the graders of
its exercise's row, and writes the JUnit XML of each into DIR.
"""
from __future__ import annotations

import functools
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from chapters.grade_report import exercise_of
from chapters.grading import exercises, implementation
from tinyvllm.engine.scheduler import Scheduler, Step
from tinyvllm.engine.sequence import Sequence, Status
from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.safetensors_format import DTYPES, TensorInfo
from tinyvllm.model import gemm
from tinyvllm.model.backend.numpy_ops import swiglu

F32 = np.float32


@dataclass(frozen=True)
class Mutant:
    chapter: int
    row: str                               # the score table's row it is graded in, e.g. "7.1 admit"
    functions: dict[str, Callable]         # exercise name -> the function standing in for the student's
    correct: bool = False                  # a right answer: its row must get full marks


# ---- 1.1: normalizes x in place (the caller's residual stream changes) ----

def rms_norm_in_place(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x *= 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    x *= weight
    return x


# ---- 2.1: three ways to let a corrupt header through ----

def _parse_header(raw: bytes, file_size: int, path, header_order_overlaps=False, bool_dims=False,
                  length_without_prefix=False):
    """The reference's checks, with one of them done wrong."""
    if len(raw) < 8:
        raise TinyVLLMError(f"{path}: too short")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > (file_size if length_without_prefix else file_size - 8):
        raise TinyVLLMError(f"{path}: header length {n} runs past the end of the file")
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError as e:
        raise TinyVLLMError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise TinyVLLMError(f"{path}: header must be a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
            raise TinyVLLMError(f"{path}: tensor {name!r}: bad entry")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        is_dim = (lambda s: isinstance(s, int)) if bool_dims else (lambda s: type(s) is int)
        if not (isinstance(shape, list) and all(is_dim(s) and s >= 0 for s in shape)):
            raise TinyVLLMError(f"{path}: tensor {name!r}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] and 8 + n + offsets[1] <= file_size):
            raise TinyVLLMError(f"{path}: tensor {name!r}: bad data_offsets {offsets!r}")
        if offsets[1] - offsets[0] != int(np.prod(shape, dtype=np.int64)) * DTYPES[entry["dtype"]].itemsize:
            raise TinyVLLMError(f"{path}: tensor {name!r}: byte count")
        tensors[name] = TensorInfo(name, entry["dtype"], tuple(shape), 8 + n + offsets[0], 8 + n + offsets[1])
    spans = [(t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin]
    if not header_order_overlaps:
        spans.sort()
    for (begin_a, end_a, a), (begin_b, end_b, b) in zip(spans, spans[1:]):
        if begin_b < end_a and begin_a < end_b:
            raise TinyVLLMError(f"{path}: tensors {a!r} and {b!r} overlap")
    return tensors, metadata


# ---- 3.1: the running max starts at 0, not -inf ----

def online_softmax_attention_max_from_zero(q, k, v, start_pos: int, block: int) -> np.ndarray:
    T, H, d = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(T, kv_heads, H // kv_heads, d).transpose(1, 2, 0, 3)
    m = np.zeros((kv_heads, H // kv_heads, T, 1), F32)
    denom, o = np.zeros_like(m), np.zeros((kv_heads, H // kv_heads, T, d), F32)
    last = min(k.shape[0], start_pos + T)
    for k0 in range(0, last, block):
        keys = np.arange(k0, min(k0 + block, last))
        s = (qg @ k[keys].transpose(1, 2, 0)[:, None]) * F32(1 / np.sqrt(d))
        s = np.where(keys[None, :] > (start_pos + np.arange(T))[:, None], F32(-np.inf), s)
        m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
        p, alpha = np.exp(s - m_new), np.exp(m - m_new)
        denom = denom * alpha + p.sum(axis=-1, keepdims=True)
        o, m = o * alpha + p @ v[keys].transpose(1, 0, 2)[:, None], m_new
    with np.errstate(invalid="ignore", divide="ignore"):
        return (o / denom).transpose(2, 0, 1, 3).reshape(T, H * d)


# ---- 4.2: a cached gemm_params whose dict gemm_params_into_slice then changes ----

@functools.cache
def gemm_params_cached(T: int, N: int, K: int) -> dict[str, int]:
    return gemm.gemm_params_into_slice(T, N, K, N)


def gemm_params_into_slice_mutating(T: int, N: int, K: int, row_stride: int) -> dict[str, int]:
    p = gemm_params_cached(T, N, K)
    p["ldc"] = row_stride
    return p


# ---- 7.1: the chunk's blocks without its cached prefix; and a right answer in the docstring's own order ----

def admit_chunk_blocks_only(scheduler: Scheduler, step: Step, free: int, budget: int) -> None:
    """Wrong: asks blocks_to_admit about the chunk's tokens alone, forgetting the cached ones before it (a
    cached prefix then seems to make the chunk's own blocks free)."""
    block_manager = scheduler.block_manager
    while scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs and budget > 0:
        seq = scheduler.waiting[0]
        hit = block_manager.lookup(seq)
        count = min(len(seq) - hit.tokens, budget, scheduler.long_prefill_token_threshold)
        need = block_manager.blocks_to_admit(hit, count)
        if need > free:
            break
        scheduler.waiting.popleft()
        seq.status, free, budget = Status.RUNNING, free - need, budget - count
        seq.num_cached = seq.num_computed = block_manager.admit(seq.seq_id, hit)
        scheduler.running.append(seq)
        step.prefills.append(seq)
        step.chunks.append(count)


def admit_in_docstring_order(scheduler: Scheduler, step: Step, free: int, budget: int) -> None:
    """Right: count and blocks first, then every check at once (with the budget spent, count is 0 and it asks
    blocks_to_admit about the cached tokens alone)."""
    block_manager = scheduler.block_manager
    while scheduler.waiting:
        seq = scheduler.waiting[0]
        hit = block_manager.lookup(seq)
        count = min(len(seq) - hit.tokens, budget, scheduler.long_prefill_token_threshold)
        need = block_manager.blocks_to_admit(hit, hit.tokens + count)
        if not (len(scheduler.running) < scheduler.max_num_seqs and budget > 0 and need <= free):
            return
        scheduler.waiting.popleft()
        seq.status = Status.RUNNING
        free -= need
        budget -= count
        seq.num_cached = seq.num_computed = block_manager.admit(seq.seq_id, hit)
        scheduler.running.append(seq)
        step.prefills.append(seq)
        step.chunks.append(count)


def admit_without_the_cap(scheduler: Scheduler, step: Step, free: int, budget: int) -> None:
    """Wrong: a long prompt takes the whole budget, and the short ones behind it wait for its prefill."""
    threshold = scheduler.long_prefill_token_threshold
    scheduler.long_prefill_token_threshold = scheduler.max_num_batched_tokens
    try:
        admit_in_docstring_order(scheduler, step, free, budget)
    finally:
        scheduler.long_prefill_token_threshold = threshold


# ---- 7.2: the last to arrive; a sequence still in its prompt first ----

def choose_victim_by_arrival(running: list[Sequence]) -> Sequence:
    return max(running, key=lambda s: s.arrival_time)


def choose_victim_prefilling_first(running: list[Sequence]) -> Sequence:
    return next((s for s in reversed(running) if not s.decoding), running[-1])


# ---- 8.3: squares summed 4 columns at a time, the tail dropped ----

def rms_norm_gemv_block_by_fours(residual, norm_weight, w, out, eps: float, block: int, cols_per_block: int) -> None:
    h = residual.shape[1] // 4 * 4
    squares = sum(residual[:, i:h:4] ** 2 for i in range(4)).sum(axis=1, keepdims=True)
    normed = residual * (1 / np.sqrt(squares / F32(residual.shape[1]) + F32(eps))) * norm_weight
    cols = slice(block * cols_per_block, min((block + 1) * cols_per_block, w.shape[0]))
    out[:, cols] = normed @ w[cols].T


# ---- 9.2: out[r] rebound instead of written ----

def parallel_mlp_rebinding(x, gate_up, down, out, all_reduce) -> None:
    for r, (xr, gu, dn) in enumerate(zip(x, gate_up, down)):
        act = np.empty((len(xr), gu.shape[0] // 2), F32)
        swiglu(xr @ gu.T, act)
        out[r] = act @ dn.T
    all_reduce(out)


# ---- 10.1: the oldest match; 10.3: the residual drawn from p; 10.4: the partly used block freed too ----

def propose_ngram_oldest_match(tokens, k, min_n, max_n):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == tokens[-n:]:
                return tokens[i + n:i + n + k]
    return []


def rejection_sample_residual_from_p(p, q, x, rng):
    if rng.random() < min(1.0, p[x] / q[x]):
        return int(x), True
    return int(rng.choice(len(p), p=p)), False


def rollback_block_table_floor(table, length, drop, block_size=16):
    if not 0 <= drop <= length or len(table) != -(-length // block_size):
        raise TinyVLLMError("bad rollback")
    keep = (length - drop) // block_size
    return list(table[:keep]), list(table[keep:])
# ---- 11.1: a star that must match once; counted repeats without their upper bound ----

def _rewrite_repeats(node, star_needs_one=False, no_upper_bound=False):
    """A regex tree with its Repeat nodes changed the way a wrong compile_dfa would read them."""
    from tinyvllm.engine.structured.regex_ast import Alt, Repeat, Seq
    if isinstance(node, (Seq, Alt)):
        return type(node)(tuple(_rewrite_repeats(i, star_needs_one, no_upper_bound) for i in node.items))
    if isinstance(node, Repeat):
        item = _rewrite_repeats(node.item, star_needs_one, no_upper_bound)
        low = 1 if star_needs_one and node.low == 0 and node.high is None else node.low
        return Repeat(item, low, None if no_upper_bound else node.high, node.separator)
    return node


def compile_dfa_star_needs_one(tree):
    from tinyvllm.engine.structured.dfa import compile_dfa
    return compile_dfa(_rewrite_repeats(tree, star_needs_one=True))


def compile_dfa_no_upper_bound(tree):
    from tinyvllm.engine.structured.dfa import compile_dfa
    return compile_dfa(_rewrite_repeats(tree, no_upper_bound=True))


# ---- 11.2: only each token's first byte checked; special tokens let through; and a right answer as a loop ----

def token_states_first_byte_only(vocab, transitions, state: int, dead: int) -> np.ndarray:
    return np.array([dead if not t else int(transitions[state, t[0]]) for t in vocab.tokens])


def token_states_specials_allowed(vocab, transitions, state: int, dead: int) -> np.ndarray:
    from tinyvllm.engine.structured.vocabulary import token_states
    return np.where(vocab.regular, token_states(vocab, transitions, state, dead), state)


def token_states_loop(vocab, transitions, state: int, dead: int) -> np.ndarray:
    out = np.full(vocab.size, dead)
    for i, token in enumerate(vocab.tokens):
        if token:
            s = state
            for byte in token:
                s = int(transitions[s, byte])
            out[i] = s
    return out


# ---- 11.3: the exercise's subset written by hand, right, and with three mistakes ----

def _schema_tree(schema: dict, optional_required=False, comma_optional=False, required_ignored=False):
    from tinyvllm.engine.structured.json_schema import INTEGER, STRING_CHAR, members_tree
    from tinyvllm.engine.structured.regex_ast import Repeat, alt, literal, optional, seq
    properties, required = schema.get("properties"), schema.get("required", [])
    if not isinstance(properties, dict) or any(name not in properties for name in required):
        raise TinyVLLMError("properties must be an object holding every required name")
    space, members = optional(literal(" ")), []
    for name, sub in properties.items():
        kind = sub.get("type")
        if kind not in ("string", "integer", "boolean"):
            raise TinyVLLMError(f"property {name!r}: type {kind!r} is not supported")
        value = {"integer": INTEGER, "boolean": alt(literal("true"), literal("false")),
                 "string": seq(literal('"'), Repeat(STRING_CHAR, 0, sub.get("maxLength")), literal('"'))}[kind]
        member = seq(literal(json.dumps(name, ensure_ascii=False)), space, literal(":"), space, value)
        members.append((member, (name in required or optional_required) and not required_ignored))
    if comma_optional:   # every property may be left out, and each may have a comma before it, or not
        comma = optional(seq(space, literal(","), space))
        body = seq(*(optional(seq(comma, m) if i else m) for i, (m, _) in enumerate(members)))
    else:
        body = members_tree(members)
    return seq(literal("{"), space, body, space, literal("}"))


MUTANTS = {
    "rms_norm in place": Mutant(1, "1.1 rms_norm", {"rms_norm": rms_norm_in_place}),
    "parse_header: overlaps in header order": Mutant(
        2, "2.1 parse_header", {"parse_header": functools.partial(_parse_header, header_order_overlaps=True)}),
    "parse_header: booleans as dimensions": Mutant(
        2, "2.1 parse_header", {"parse_header": functools.partial(_parse_header, bool_dims=True)}),
    "parse_header: length without the prefix": Mutant(
        2, "2.1 parse_header", {"parse_header": functools.partial(_parse_header, length_without_prefix=True)}),
    "online softmax: max from 0": Mutant(3, "3.1 online_softmax_attention",
                                         {"online_softmax_attention": online_softmax_attention_max_from_zero}),
    "gemm_params cached, its dict changed": Mutant(4, "4.2 gemm_params_into_slice", {
        "gemm_params": gemm_params_cached, "gemm_params_into_slice": gemm_params_into_slice_mutating}),
    "admit: the chunk's blocks only": Mutant(7, "7.1 admit", {"admit": admit_chunk_blocks_only}),
    "admit in the docstring's order": Mutant(7, "7.1 admit", {"admit": admit_in_docstring_order}, correct=True),
    "admit without the long-prefill cap": Mutant(7, "7.1 admit", {"admit": admit_without_the_cap}),
    "choose_victim by arrival": Mutant(7, "7.2 choose_victim", {"choose_victim": choose_victim_by_arrival}),
    "choose_victim: prefilling first": Mutant(7, "7.2 choose_victim",
                                              {"choose_victim": choose_victim_prefilling_first}),
    "rms_norm_gemv_block by fours": Mutant(8, "8.3 rms_norm_gemv_block",
                                           {"rms_norm_gemv_block": rms_norm_gemv_block_by_fours}),
    "parallel_mlp rebinding out": Mutant(9, "9.2 parallel_mlp", {"parallel_mlp": parallel_mlp_rebinding}),
    "propose_ngram: the oldest match": Mutant(10, "10.1 propose_ngram", {"propose_ngram": propose_ngram_oldest_match}),
    "rejection_sample: the residual from p": Mutant(10, "10.3 rejection_sample",
                                                    {"rejection_sample": rejection_sample_residual_from_p}),
    "rollback_block_table: the partly used block freed": Mutant(10, "10.4 rollback_block_table",
                                                               {"rollback_block_table": rollback_block_table_floor}),
    "compile_dfa: a star must match once": Mutant(11, "11.1 compile_dfa", {"compile_dfa": compile_dfa_star_needs_one}),
    "compile_dfa: {m,n} read as {m,}": Mutant(11, "11.1 compile_dfa", {"compile_dfa": compile_dfa_no_upper_bound}),
    "token_states: the first byte only": Mutant(11, "11.2 token_states",
                                                {"token_states": token_states_first_byte_only}),
    "token_states: special tokens allowed": Mutant(11, "11.2 token_states",
                                                   {"token_states": token_states_specials_allowed}),
    "token_states as a loop": Mutant(11, "11.2 token_states", {"token_states": token_states_loop}, correct=True),
    "schema_tree: the subset by hand": Mutant(11, "11.3 schema_tree", {"schema_tree": _schema_tree}, correct=True),
    "schema_tree: optional properties required": Mutant(
        11, "11.3 schema_tree", {"schema_tree": functools.partial(_schema_tree, optional_required=True)}),
    "schema_tree: the comma optional": Mutant(
        11, "11.3 schema_tree", {"schema_tree": functools.partial(_schema_tree, comma_optional=True)}),
    "schema_tree: required ignored": Mutant(
        11, "11.3 schema_tree", {"schema_tree": functools.partial(_schema_tree, required_ignored=True)}),
}


# ---- grading them ----

class Grading:
    """A pytest plugin that grades one mutant as the student's answer: the chapter's exercises.py becomes the
    engine's reference functions with the mutant's in their place (until pytest is done), and only the
    graders of the mutant's row run."""

    def __init__(self, mutant: Mutant):
        self.mutant, self.saved = mutant, {}

    def pytest_configure(self, config) -> None:
        ex = exercises(self.mutant.chapter)
        for name in ex.REFERENCE:
            self.saved[name] = getattr(ex, name)
            setattr(ex, name, self.mutant.functions.get(name) or implementation(self.mutant.chapter, name, "reference"))

    def pytest_unconfigure(self, config) -> None:
        for name, function in self.saved.items():
            setattr(exercises(self.mutant.chapter), name, function)

    def pytest_collection_modifyitems(self, config, items: list) -> None:
        keep = [item for item in items if exercise_of(item.name, self.mutant.chapter) == self.mutant.row]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


def grade_all(out: Path) -> None:
    """Grade every mutant, one pytest run each in this one process (the imports are paid once): JUnit XML
    in out/<index in MUTANTS>.xml."""
    for index, mutant in enumerate(MUTANTS.values()):
        pytest.main(["-q", "-p", "no:cacheprovider", "--impl=student", "-m", f"ch{mutant.chapter}",
                     f"--junitxml={out / f'{index}.xml'}", f"tests/test_ch{mutant.chapter:02d}_exercises.py"],
                    plugins=[Grading(mutant)])


if __name__ == "__main__":
    grade_all(Path(sys.argv[1]))
