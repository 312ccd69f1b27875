"""Chapter 10 graders: the n-gram proposer (Exercise 10.1), greedy acceptance (10.2), the rejection-sampling
rule (10.3) and the KV rollback of a block table (10.4), on the CPU.

propose_ngram is checked on hand-derived sequences and on random ones over a small alphabet (many matches)
against a loop the grader writes out window by window. accept_greedy against target[:m + 1] with m the
number of agreeing guesses. rejection_sample is a statistical test: with a FIXED seed, 20,000 positions per
pair of distributions (p, q), the emitted tokens must pass a chi-square test against p, and the share of
guesses kept must be sum(min(p, q)) within 5 standard deviations. The grader proves it can fail: the plain
tests (not marked ch10) below run the same check on plausible wrong rules — the residual drawn from p instead
of max(0, p - q), p/q unclipped handed to a Bernoulli draw, the ratio upside down, p(x) as the acceptance
probability, never accepting — and each must fail. rollback_block_table against the engine's
BlockManager.truncate on a real manager. Finally the three engine-side functions run inside the engine on a
tiny random model: its greedy tokens with speculation must be the ones without.
"""
from __future__ import annotations

import numpy as np
import pytest

from chapters.ch10_speculative import checkpoint as ch10
from chapters.ch10_speculative import speculative
from tests.numeric import show
from tinyvllm import LLM
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.errors import TinyVLLMError
from tinyvllm.model import sampler

# ---------- 10.1 propose_ngram ----------

NGRAM_CASES = {   # (tokens, k, min_n, max_n) -> proposal, derived by hand
    "the docstring's example": (([1, 2, 3, 9, 1, 2], 3, 1, 2), [3, 9, 1]),
    "the most recent match": (([5, 6, 1, 5, 6, 2, 7, 5, 6], 2, 2, 2), [2, 7]),
    "longest n first": (([4, 9, 1, 8, 9, 2, 0, 4, 9], 2, 1, 2), [1, 8]),   # n=1 alone would pick 9 -> [2, 0]
    "falls back to a shorter n": (([3, 1, 4, 7, 2, 1], 3, 1, 3), [4, 7, 2]),
    "fewer than k near the end": (([8, 3, 8], 5, 1, 1), [3, 8]),
    "no match": (([1, 2, 3, 4], 3, 1, 3), []),
    "below min_n is no match": (([1, 5, 2, 1], 2, 2, 3), []),
    "the suffix itself does not count": (([7, 7], 2, 1, 1), [7]),
    "one token": (([7], 3, 1, 3), []),
    "a run repeats itself": (([2, 2, 2, 2], 3, 2, 3), [2]),
}


def ngram_by_hand(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        for i in range(len(tokens) - n - 1, -1, -1):    # the most recent window with a token after it
            if tokens[i:i + n] == tokens[-n:]:
                return tokens[i + n:i + n + k]
    return []


@pytest.mark.ch10
@pytest.mark.parametrize("case", NGRAM_CASES)
def test_propose_ngram_hand_derived(impl, case):
    (tokens, k, min_n, max_n), expected = NGRAM_CASES[case]
    given = list(tokens)
    got = impl("propose_ngram")(given, k, min_n, max_n)
    assert isinstance(got, list), f"{case}: expected a list, got {type(got).__name__}"
    assert got == expected, f"{case}: propose_ngram({tokens}, k={k}, min_n={min_n}, max_n={max_n}) = {got}, " \
                            f"expected {expected}"
    assert given == tokens, f"{case}: propose_ngram changed the tokens it was given"


@pytest.mark.ch10
@pytest.mark.parametrize("alphabet", [2, 4, 12])
def test_propose_ngram_random_sequences(impl, rng, alphabet):
    propose = impl("propose_ngram")
    for _ in range(150):
        tokens = rng.integers(0, alphabet, int(rng.integers(1, 40))).tolist()
        k, min_n = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        got, expected = propose(list(tokens), k, min_n, max_n), ngram_by_hand(tokens, k, min_n, max_n)
        assert [int(t) for t in got] == expected, (
            f"propose_ngram({show(tokens, 40)}, k={k}, min_n={min_n}, max_n={max_n}) = {got}, expected {expected}")
        assert all(type(t) is int for t in got), f"propose_ngram returned {[type(t).__name__ for t in got]}: plain ints"


# ---------- 10.2 accept_greedy ----------

ACCEPT_CASES = {   # (proposals, target) -> emitted
    "all kept, then the bonus": (([5, 6, 7], [5, 6, 7, 8]), [5, 6, 7, 8]),
    "the first rejected": (([5, 6, 7], [4, 6, 7, 8]), [4]),
    "the second rejected": (([5, 6, 7], [5, 9, 7, 8]), [5, 9]),
    "agreement after a rejection does not count": (([5, 6, 7], [5, 1, 7, 8]), [5, 1]),
    "no proposals: plain decoding": (([], [3]), [3]),
    "one proposal kept": (([3], [3, 3]), [3, 3]),
}


@pytest.mark.ch10
@pytest.mark.parametrize("case", ACCEPT_CASES)
def test_accept_greedy_hand_derived(impl, case):
    (proposals, target), expected = ACCEPT_CASES[case]
    got = impl("accept_greedy")(list(proposals), list(target))
    assert [int(t) for t in got] == expected, \
        f"{case}: accept_greedy({proposals}, target={target}) = {got}, expected {expected}"


@pytest.mark.ch10
def test_accept_greedy_random(impl, rng):
    accept = impl("accept_greedy")
    for _ in range(300):
        k = int(rng.integers(0, 8))
        target = rng.integers(0, 50, k + 1).tolist()
        m = int(rng.integers(0, k + 1))             # the guesses that agree
        proposals = target[:m] + [(t + 1 + int(rng.integers(0, 5))) % 50 for t in target[m:k]]
        if m + 1 < k and rng.random() < 0.5:   # guesses after the first rejected one agree again: still dropped
            proposals[m + 1:] = target[m + 1:k]
        got = accept(list(proposals), list(target))
        assert [int(t) for t in got] == target[:m + 1], \
            f"accept_greedy({proposals}, target={target}) = {got}, expected {target[:m + 1]}"


@pytest.mark.ch10
@pytest.mark.parametrize("proposals, target", [([1, 2], [1, 2]), ([1, 2], [1, 2, 3, 4]), ([], [])])
def test_accept_greedy_refuses_a_target_of_the_wrong_length(impl, proposals, target):
    with pytest.raises(TinyVLLMError):
        impl("accept_greedy")(proposals, target)


# ---------- 10.3 rejection_sample ----------

DRAWS, SIGNIFICANCE = 20_000, 1e-4


def pairs() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(p, q) pairs, made once from a fixed seed: the statistical test must not depend on the session's seed."""
    g = np.random.default_rng(2023)

    def dist(weights):
        w = np.asarray(weights, np.float64)
        return w / w.sum()

    return {
        "draft too confident": (dist([5, 3, 1, 1]), dist([1, 1, 6, 2])),
        "draft too flat": (dist([12, 4, 2, 1, 1, 0.5]), dist([1, 1, 1, 1, 1, 1])),
        "target has zeros": (dist([0, 3, 0, 5, 2]), dist([2, 1, 2, 1, 1])),
        "random, 8 tokens": (dist(g.dirichlet(np.full(8, 0.7))), dist(g.dirichlet(np.full(8, 0.7)))),
        "equal": (dist([1, 2, 3, 4]), dist([1, 2, 3, 4])),
    }


PAIRS = pairs()


def rejection_problems(rule, p: np.ndarray, q: np.ndarray, seed: int = 10) -> list[str]:
    """What is wrong with `rule` on (p, q): an empty list if its tokens pass the chi-square test against p and
    it keeps the draft's guess as often as sum(min(p, q)) says."""
    try:
        with np.errstate(all="ignore"):   # a wrong rule may divide 0 by 0: its error is the finding, not a warning
            counts, kept = speculative.draw_many(rule, p, q, DRAWS, seed)
    except (ValueError, ZeroDivisionError, FloatingPointError) as e:
        return [f"raised {type(e).__name__}: {e}"]
    problems = []
    p_value = speculative.chi_square_p_value(counts, p)
    if not p_value > SIGNIFICANCE:
        problems.append(f"the emitted tokens are not distributed as p (chi-square p-value {p_value:.1e} over {DRAWS:,} "
                        f"draws): counts {counts.tolist()}, expected about {np.round(DRAWS * p).astype(int).tolist()}")
    expected = float(np.minimum(p, q).sum())
    sigma = np.sqrt(DRAWS * expected * (1 - expected)) + 1e-9
    if abs(kept - DRAWS * expected) > 5 * sigma:
        problems.append(f"kept the draft's guess {kept / DRAWS:.1%} of the time; min(1, p/q) keeps it "
                        f"sum(min(p, q)) = {expected:.1%} of the time")
    return problems


@pytest.mark.ch10
@pytest.mark.parametrize("pair", PAIRS)
def test_rejection_sample_leaves_the_target_distribution_unchanged(impl, pair):
    p, q = PAIRS[pair]
    problems = rejection_problems(impl("rejection_sample"), p.copy(), q.copy())
    assert not problems, f"{pair}: p = {np.round(p, 3).tolist()}, q = {np.round(q, 3).tolist()}: " + "; ".join(problems)


@pytest.mark.ch10
def test_rejection_sample_keeps_a_kept_guess_and_uses_only_its_rng(impl):
    rule = impl("rejection_sample")
    p, q = PAIRS["draft too confident"]
    before = p.copy(), q.copy()
    runs = []
    for _ in range(2):
        rng = np.random.default_rng(7)
        runs.append([rule(p, q, x, rng) for x in [0, 2, 2, 3, 1, 2, 0, 2] * 10])
    assert runs[0] == runs[1], "two runs from the same seed differ: draw only from the rng you are given"
    for (token, kept), x in zip(runs[0], [0, 2, 2, 3, 1, 2, 0, 2] * 10):
        assert not kept or token == x, f"said it kept the guess {x} but returned {token}"
        if q[x] <= p[x]:
            assert kept, f"p[{x}] = {p[x]:.3f} >= q[{x}] = {q[x]:.3f}: min(1, p/q) = 1, the guess is always kept"
    assert np.array_equal(p, before[0]) and np.array_equal(q, before[1]), "rejection_sample changed p or q"


# ---- the grader's self-test: the statistical check fails each plausible wrong rule (not graded: no ch10 mark) ----

def residual_from_p(p, q, x, rng):
    if rng.random() < min(1.0, p[x] / q[x]):
        return int(x), True
    return int(rng.choice(len(p), p=p)), False


def unclipped_bernoulli(p, q, x, rng):
    if rng.binomial(1, p[x] / q[x]):     # a probability above 1: NumPy refuses it
        return int(x), True
    residual = np.maximum(p - q, 0)
    return int(rng.choice(len(p), p=residual / residual.sum())), False


def ratio_upside_down(p, q, x, rng):
    if rng.random() < min(1.0, q[x] / max(p[x], 1e-300)):
        return int(x), True
    residual = np.maximum(p - q, 0)
    return int(rng.choice(len(p), p=residual / residual.sum())), False


def accept_with_p(p, q, x, rng):
    if rng.random() < p[x]:                 # the one-hot rule of the engine's verify, with a draft that is not one-hot
        return int(x), True
    residual = np.maximum(p - q, 0)
    return int(rng.choice(len(p), p=residual / residual.sum())), False


def residual_unclipped_abs(p, q, x, rng):
    if rng.random() < min(1.0, p[x] / q[x]):
        return int(x), True
    residual = np.abs(p - q)                # |p - q| instead of max(0, p - q)
    return int(rng.choice(len(p), p=residual / residual.sum())), False


def never_accept(p, q, x, rng):
    rng.random()
    return int(rng.choice(len(p), p=p)), False   # the right distribution, and no speed-up at all


WRONG_RULES = [residual_from_p, unclipped_bernoulli, ratio_upside_down, accept_with_p, residual_unclipped_abs,
               never_accept]


@pytest.mark.parametrize("rule", WRONG_RULES, ids=[r.__name__ for r in WRONG_RULES])
def test_the_rejection_grader_fails_a_wrong_rule(rule):
    failing = [name for name, (p, q) in PAIRS.items() if rejection_problems(rule, p, q)]
    assert failing, f"{rule.__name__} passes the statistical check on every pair: the grader cannot fail it"


def test_the_rejection_grader_passes_the_reference_on_other_seeds():
    for seed in (1, 2, 3):
        for name, (p, q) in PAIRS.items():
            assert not rejection_problems(speculative.rejection_sample, p, q, seed), f"{name}, seed {seed}"


# ---------- 10.4 rollback_block_table ----------

ROLLBACK_CASES = {   # (table, length, drop) -> (new table, freed), 16 tokens a block
    "drop nothing": (([7, 3], 20, 0), ([7, 3], [])),
    "stay in the last block": (([7, 3], 20, 3), ([7, 3], [])),
    "empty the last block": (([7, 3], 20, 4), ([7], [3])),
    "back to a block edge": (([7, 3, 9], 33, 1), ([7, 3], [9])),
    "two blocks go": (([7, 3, 9], 40, 25), ([7], [3, 9])),
    "everything": (([7, 3], 20, 20), ([], [7, 3])),
    "a full last block, one token dropped": (([5, 1], 32, 1), ([5, 1], [])),
}


@pytest.mark.ch10
@pytest.mark.parametrize("case", ROLLBACK_CASES)
def test_rollback_block_table_hand_derived(impl, case):
    (table, length, drop), expected = ROLLBACK_CASES[case]
    given = list(table)
    got = impl("rollback_block_table")(given, length, drop)
    assert tuple(map(list, got)) == expected, \
        f"{case}: rollback_block_table({table}, length={length}, drop={drop}) = {got}, expected {expected}"
    assert given == table, f"{case}: rollback_block_table changed the table it was given"


@pytest.mark.ch10
def test_rollback_block_table_matches_the_block_manager(impl, rng):
    """Against the engine's BlockManager.truncate on a real manager, with other block sizes too."""
    rollback = impl("rollback_block_table")
    for _ in range(200):
        manager = BlockManager(64)
        manager.allocate(0, int(rng.integers(0, 20)))                  # another sequence: the blocks are not 0, 1, ...
        length = int(rng.integers(1, 200))
        manager.allocate(1, length)
        table, drop = list(manager.tables[1]), int(rng.integers(0, length + 1))
        free_before = set(manager.free_blocks)
        manager.truncate(1, length - drop)
        new, freed = rollback(list(table), length, drop)
        what = f"rollback_block_table({show(table)}, length={length}, drop={drop})"
        assert list(new) == manager.tables[1], f"{what}: table {new}, BlockManager.truncate keeps {manager.tables[1]}"
        assert list(freed) == [b for b in table if b in set(manager.free_blocks) - free_before], \
            f"{what}: freed {freed}; truncate gave back {sorted(set(manager.free_blocks) - free_before)} (in table order)"
    for block_size, (table, length, drop), expected in [(4, ([2, 8, 5], 10, 3), ([2, 8], [5])),
                                                        (1, ([4, 6, 1], 3, 2), ([4], [6, 1]))]:
        got = rollback(table, length, drop, block_size)
        assert tuple(map(list, got)) == expected, \
            f"rollback_block_table({table}, {length}, {drop}, block_size={block_size}) = {got}, expected {expected}"


@pytest.mark.ch10
@pytest.mark.parametrize("table, length, drop", [([1, 2], 20, 21), ([1, 2], 20, -1), ([1], 20, 2), ([1, 2, 3], 20, 2)],
                         ids=["drop more than held", "negative drop", "table too short", "table too long"])
def test_rollback_block_table_refuses_what_cannot_be(impl, table, length, drop):
    with pytest.raises(TinyVLLMError):
        impl("rollback_block_table")(table, length, drop)


# ---------- all together: inside the engine ----------

@pytest.mark.ch10
def test_speculation_inside_the_engine_changes_no_greedy_token(impl, monkeypatch, tiny_model_dir):
    """The proposer, the acceptance rule and the rollback inside the engine on a tiny random model: the greedy
    tokens with speculation are the ones without, some guesses were verified, and every block came back."""
    for name in ("propose_ngram", "accept_greedy", "rollback_block_table"):
        monkeypatch.setattr(speculative, name, impl(name))
    monkeypatch.setattr(sampler, "verify", sampler.verify)   # plug_into replaces it: put it back afterwards
    llm = LLM(str(tiny_model_dir), device="cpu", speculative_method="ngram", num_speculative_tokens=3,
              prompt_lookup_min=1, num_blocks=64)
    ch10.plug_into(llm)
    manager = llm.engine.scheduler.block_manager
    free_before, verified = manager.num_free, 0
    try:
        for prompt in ["one two three one two three one two", "a b c d e f g a b c d e f g a b"]:
            off, on = ch10.run(llm, prompt, False, 24), ch10.run(llm, prompt, True, 24)
            assert on.tokens == off.tokens, f"{prompt!r}: tokens with speculation {on.tokens}, without {off.tokens}"
            verified += sum(on.emitted.values())
    finally:
        llm.close()
    assert verified, "no verification happened: the proposer never proposed"
    assert manager.num_free == free_before, f"{free_before - manager.num_free} blocks were not given back"
