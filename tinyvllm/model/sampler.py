"""Chapter 5: turning logits into the next token, as the request's SamplingParams say (engine/sampling.py).

temperature 0 is greedy (argmax); otherwise the logits are divided by the temperature, cut by top-k and
min-p, then by top-p among the survivors (vLLM's order), renormalized and drawn from. Before either, the
penalties (presence, frequency, repetition) change the logits of tokens already seen, as in vLLM.
It all runs where the logits are (NumPy or CuPy: the same code), so a GPU never copies a 128K-entry
logits row to the host: only the chosen id comes back (and, when asked, the k+1 log-probabilities).
The randomness is one uniform number per token from the request's own seeded generator on the host,
turned into a token by inverting the kept tokens' cumulative distribution — so a seed gives the same
tokens on every run.

A structured output's mask (Sampling.allowed) comes first: the tokens it forbids get logit -inf before
anything else, so greedy, penalties, temperature, top-k/p, min-p and the logprobs all see the masked
distribution (vLLM's behaviour).

sample_step does it for a whole step (the model runner calls it): the plain greedy rows with one argmax,
the others in a few batched passes (sample_rows: 256 rows row by row would be thousands of small launches
a step), a sequence verifying proposals (chapter 10) position by position (verify), the logprobs of the
rows that ask with one log-softmax; a sequence whose sampling fails is that sequence's alone.
"""
from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import numpy as np

from tinyvllm.model.mask_table import MaskTable
from tinyvllm.model.step_plan import Sampling, StepOutput

def sample(logits, params, rng: np.random.Generator, in_order: bool = False) -> int:
    """One token id from a (vocab,) logits vector, a NumPy or CuPy array: sample_rows of one row (sample_in_order's
    when in_order and nothing is cut: the batch-invariant mode)."""
    if params.temperature == 0:
        return int(array_module(logits).argmax(logits))
    draw = sample_in_order if in_order and not cuts(params) else sample_rows
    return draw(logits[None, :], [params], [rng])[0]


def sample_rows_on_device(logits, params: list, rngs: list[np.random.Generator]):
    """One token per row of a (rows, vocab) batch of logits, every row with temperature > 0: row r as params[r]
    says, with one uniform number from rngs[r]; the ids stay where the logits are. Every reduction runs along a row,
    so a row's token does not depend on the others. The rows are all cut (top-k, min-p or top-p: a sort) or none is: an uncut row is
    drawn from the vocabulary's own order, a cut one from the sorted order."""
    xp = array_module(logits)
    temperature = xp.asarray([p.temperature for p in params], dtype=xp.float64)[:, None]
    z = logits.astype(xp.float64) / temperature  # float64: exp of large logits stays accurate
    probs = xp.exp(z - z.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    if any(cuts(p) for p in params):
        order, cdf, kept = cut_cdf(probs, params)
    else:  # nothing to cut: no sort needed
        order, cdf, kept = None, xp.cumsum(probs, axis=1), probs.shape[1]
    u = xp.asarray([rng.random() for rng in rngs]) * cdf[:, -1]  # the numbers that cross from the host
    i = xp.minimum((cdf <= u[:, None]).sum(axis=1), kept - 1)   # searchsorted(side="right"), never past the kept
    return i if order is None else xp.take_along_axis(order, i[:, None], axis=1)[:, 0]


def sample_rows(logits, params: list, rngs: list[np.random.Generator]) -> list[int]:
    """sample_rows_on_device, the tokens brought to the host."""
    return to_host(sample_rows_on_device(logits, params, rngs)).tolist()


def argmax_rows(logits):
    """logits.argmax(axis=1) by the backend's argmax (kernels/argmax.cu, or its NumPy twin): NumPy's answer (the first
    index of the maximum, or of the first NaN), each row in pieces over the whole GPU. CuPy's own argmax reduces a row
    in one block: one 128K-entry row, on one of an H200's 132 SMs, took 107 us of a 1.3 ms decode step."""
    xp = array_module(logits)
    out = xp.empty(len(logits), dtype=np.int32)
    backend_ops(xp).argmax(xp.ascontiguousarray(logits, dtype=np.float32), out)
    return out


def backend_ops(xp):
    """The backend whose kernels work on xp's arrays (cuda_ops for CuPy, numpy_ops for NumPy)."""
    if xp is np:
        from tinyvllm.model.backend import numpy_ops
        return numpy_ops
    from tinyvllm.model.backend import cuda_ops
    return cuda_ops


def cuts(params) -> bool:
    return params.top_k > 0 or params.min_p > 0 or params.top_p < 1


def cut_cdf(probs, params: list):
    """vLLM's order: top-k and min-p, then top-p among the tokens they kept. Returns the sort order (most likely
    first), the cumulative distribution of the kept tokens in that order, and how many each row keeps."""
    xp, vocab = array_module(probs), probs.shape[1]
    order = xp.argsort(-probs, axis=1, kind="stable") if xp is np else xp.argsort(-probs, axis=1)
    sorted_probs = xp.take_along_axis(probs, order, axis=1)
    column = lambda values, dtype: xp.asarray(values, dtype=dtype)[:, None]  # noqa: E731  (one value per row)
    keep = xp.arange(vocab)[None, :] < column([p.top_k if p.top_k > 0 else vocab for p in params], np.int64)
    keep &= sorted_probs >= column([p.min_p for p in params], np.float64) * sorted_probs[:, :1]
    kept_probs = xp.where(keep, sorted_probs, 0.0)
    mass = kept_probs / kept_probs.sum(axis=1, keepdims=True)
    top_p = column([p.top_p for p in params], np.float64)
    keep &= ((xp.cumsum(mass, axis=1) - mass) < top_p) | (top_p >= 1)  # keep a token if the mass before it is below top_p
    return order, xp.cumsum(xp.where(keep, sorted_probs, 0.0), axis=1), keep.sum(axis=1)


# ---- penalties (vLLM's rule), applied to the logits before greedy or sampling ----

def apply_penalties(logits, params, prompt_ids: list[int], output_ids: list[int]):
    """A penalized float32 copy of one (vocab,) logits row (the raw row stays, for logprobs). Repetition:
    every token seen in the prompt or the output has a positive logit divided by repetition_penalty, a
    negative one multiplied. Then, over the output only: minus frequency x count, minus presence if seen.
    Only the ids of seen tokens and their counts cross to the device."""
    xp = array_module(logits)
    row = logits.astype(xp.float32)  # a copy: the raw logits must survive for logprobs
    if params.repetition_penalty != 1:
        seen = xp.asarray(np.unique(np.asarray(prompt_ids + output_ids, dtype=np.int64)))
        hit = row[seen]
        row[seen] = xp.where(hit > 0, hit / params.repetition_penalty, hit * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        cut = params.frequency_penalty * counts + params.presence_penalty
        row[xp.asarray(ids)] -= xp.asarray(cut.astype(np.float32))
    return row


# ---- logprobs (vLLM's raw_logprobs: from the model's logits, before penalties, temperature, top-k/p) ----

def raw_logprobs(logits, tokens: list[int], k: int):
    """Log-softmax of a (rows, vocab) batch of logits, reduced where it is: per row the k likeliest
    tokens (ids and logprobs, in no particular order) and the sampled token's logprob and rank.
    Returns four arrays on the logits' device; only (rows, k + 2) numbers need to cross to the host."""
    xp, k = array_module(logits), min(k, logits.shape[1])
    shifted = logits - logits.max(axis=1, keepdims=True)
    lp = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
    chosen = lp[xp.arange(len(tokens)), xp.asarray(tokens)]
    ranks = 1 + (lp > chosen[:, None]).sum(axis=1)
    top = xp.argpartition(-lp, k - 1, axis=1)[:, :k] if k else xp.zeros((len(tokens), 0), dtype=xp.int64)
    return top, xp.take_along_axis(lp, top, axis=1), chosen, ranks


def array_module(a):
    """numpy for NumPy arrays, cupy for CuPy arrays (without importing CuPy on the CPU)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy
    return cupy


# ---- a whole step: what the model runner calls ----

def sample_step(logits, samplings: list[Sampling | None], proposals: list[list[int]] | None = None,
                batched: bool = True, mask_table: MaskTable | None = None) -> StepOutput:
    """Entry i of the step owns len(proposals[i]) + 1 consecutive rows of logits (rows, vocab), on the device: one
    row, or one per proposed token and one more when it verifies proposals (chapter 10). It emits what verify()
    keeps of its proposals (just the drawn token without any), drawn as samplings[i] says (None: no token). The
    plain greedy rows take ONE argmax; the other one-row entries are drawn in groups of one kind (greedy with
    penalties, sampled, sampled and cut), each group at once — or one by one when not batched (the
    batch-invariant mode: a GPU reduction's order may depend on the rows beside). Only ids and the asked
    logprobs reach the host. An entry whose sampling or logprobs fail gets no ids and its error. The masks of
    structured outputs come through mask_table (the runner's: each crosses to the device once) when given."""
    proposals = proposals or [[] for _ in samplings]
    firsts = [0, *accumulate(len(p) + 1 for p in proposals)][:-1]   # each entry's first row
    tokens: list[list[int]] = [[] for _ in samplings]
    errors: dict[int, Exception] = {}
    logits = apply_masks(logits, samplings, firsts, mask_table)
    plain = [i for i, s in enumerate(samplings) if s is not None and is_plain_greedy(s.params)]
    if plain:   # the greedy rows without penalties, all with ONE argmax (no gather when every row is one)
        rows = [firsts[i] + j for i in plain for j in range(len(proposals[i]) + 1)]
        best = to_host(argmax_rows(logits if len(rows) == len(logits) else logits[rows])).tolist()
        at = dict(zip(rows, best))
        for i in plain:
            tokens[i] = verify(lambda j, accepted: at[firsts[i] + j], proposals[i])
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samplings):
        if s is None or i in plain:
            continue
        if proposals[i]:   # verifying: position by position, each draw after the tokens accepted before it
            try:
                tokens[i] = verify(lambda j, accepted: draw_at(logits[firsts[i] + j], s, accepted, not batched),
                                   proposals[i])
            except Exception as e:   # this entry's alone: the others go on
                errors[i] = e
        else:
            groups.setdefault(group_of(i, s.params, batched), []).append(i)
    for entries in groups.values():
        draw_group(logits, samplings, entries, [firsts[i] for i in entries], tokens, errors, batched)
    return StepOutput(tokens, step_logprobs(logits, samplings, tokens, firsts, errors), errors)


def samples_on_device(sampling: Sampling | None) -> bool:
    """Whether an entry's token can be drawn without the host: no penalties (they count the tokens on the host), no
    logprobs, no structured output's mask (both need the drawn token on the host)."""
    return sampling is None or (not sampling.params.has_penalties and sampling.params.logprobs is None
                                and sampling.allowed is None)


def sample_on_device(logits, samplings: list[Sampling | None], batched: bool = True):
    """One token per row of a step's logits, one entry a row, every sampling samples_on_device, drawn as sample_step
    draws them (the same tokens): the greedy rows with one argmax, the others in groups of one kind. The ids stay on
    the device (a row nobody samples gets some id, never read), so the next step can take them as its input before
    the host has seen them (chapter 7's async scheduling); the host reads them later, in one copy."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samplings):
        if s is not None:
            groups.setdefault("greedy" if s.params.temperature == 0 else group_of(i, s.params, batched), []).append(i)
    if set(groups) <= {"greedy"}:
        return argmax_rows(logits)
    tokens = array_module(logits).zeros(len(samplings), dtype=np.int64)
    for entries in groups.values():
        tokens[entries] = draw_rows_on_device(logits, [samplings[i] for i in entries], entries, batched)
    return tokens


def kind(params) -> str:
    """One-row entries of one kind are drawn together: greedy (with penalties), sampled, or sampled and cut."""
    return "greedy" if params.temperature == 0 else "cut" if cuts(params) else "sampled"


def group_of(entry: int, params, batched: bool) -> str:
    """Which entries are drawn together: one kind each, or in the batch-invariant mode (not batched) each greedy or cut
    entry alone (a GPU reduction's order may depend on the rows beside); uncut sampled rows still go together there,
    sample_in_order being per row."""
    return kind(params) if batched or kind(params) == "sampled" else str(entry)


def draw_group(logits, samplings: list[Sampling | None], entries: list[int], rows: list[int], tokens: list,
               errors: dict, batched: bool = True) -> None:
    """One token for each entry of one kind (entry i's logits in row rows[...]), all at once. If that fails, each
    alone from its random state before, so a failure is its entry's alone and the others draw what they would
    have drawn."""
    states = [samplings[i].rng.bit_generator.state for i in entries]
    try:
        drawn = draw_rows(logits, [samplings[i] for i in entries], rows, batched)
    except Exception as e:
        if len(entries) == 1:
            errors[entries[0]] = e
            return
        for i, row, state in zip(entries, rows, states):
            samplings[i].rng.bit_generator.state = state
            draw_group(logits, samplings, [i], [row], tokens, errors, batched)
        return
    for i, token in zip(entries, drawn):
        tokens[i] = [token]


def draw_rows(logits, samplings: list[Sampling], rows: list[int], batched: bool = True) -> list[int]:
    """draw_rows_on_device, the tokens brought to the host."""
    return to_host(draw_rows_on_device(logits, samplings, rows, batched)).tolist()


def draw_rows_on_device(logits, samplings: list[Sampling], rows: list[int], batched: bool = True):
    """The penalized rows (each its own copy), then one argmax or one sample_rows for all of them (sample_in_order
    when not batched: the batch-invariant mode); the ids stay on the device."""
    xp = array_module(logits)
    if any(s.params.has_penalties for s in samplings):
        batch = xp.stack([apply_penalties(logits[r], s.params, s.prompt_ids, s.output_ids)
                          if s.params.has_penalties else logits[r] for r, s in zip(rows, samplings)])
    else:
        batch = logits[rows]
    if samplings[0].params.temperature == 0:
        return argmax_rows(batch)
    params = [s.params for s in samplings]
    draw = sample_in_order_on_device if not batched and not any(cuts(p) for p in params) else sample_rows_on_device
    return draw(batch, params, [s.rng for s in samplings])


def sample_in_order(logits, params: list, rngs: list[np.random.Generator]) -> list[int]:
    """sample_in_order_on_device, the tokens brought to the host."""
    return to_host(sample_in_order_on_device(logits, params, rngs)).tolist()


def sample_in_order_on_device(logits, params: list, rngs: list[np.random.Generator]):
    """sample_rows for rows that cut nothing, as the batch-invariant mode draws them (chapter 7): the backend's
    sample_rows (kernels/sample_rows.cu, or its NumPy twin) sums each row in an order fixed by the vocabulary size,
    so a row's token does not depend on how many rows are drawn with it. One uniform number per row, as ever.
    (A library's batched softmax and cumsum pick their schedule from the whole array's shape.)"""
    xp = array_module(logits)
    out = xp.empty(len(params), dtype=np.int32)
    backend_ops(xp).sample_rows(xp.ascontiguousarray(logits, dtype=np.float32), xp.asarray([1 / p.temperature for p in params]),
                    xp.asarray([rng.random() for rng in rngs]), out)
    return out


def verify(target: Callable[[int, list[int]], int], proposals: list[int]) -> list[int]:
    """Chapter 10's acceptance rule, for proposals from a deterministic proposer (n-gram lookup, a greedy draft).
    target(j, accepted) is the target model's token at position j, drawn as plain decoding would draw it after
    the tokens accepted so far. A proposal is kept while it equals the target's token; the first that differs is
    replaced by the target's (the bonus token), and after k kept ones the target's next token is the bonus.
    One draw per emitted token, in order: the same seed emits the same tokens with or without speculation.
    It is Leviathan et al.'s rejection sampling when the proposal distribution is one-hot on x: accept x with
    probability p(x), else draw from p without x, renormalized — exactly a draw from p that did not give x."""
    emitted = [target(0, [])]
    while len(emitted) <= len(proposals) and emitted[-1] == proposals[len(emitted) - 1]:
        emitted.append(target(len(emitted), emitted))
    return emitted


def draw_at(row, s: Sampling, accepted: list[int], in_order: bool = False) -> int:
    """One token from one row of logits, as s says; the penalties count the tokens accepted before this position."""
    if s.params.has_penalties:
        row = apply_penalties(row, s.params, s.prompt_ids, s.output_ids + accepted)
    return sample(row, s.params, s.rng, in_order)


def apply_masks(logits, samplings: list[Sampling | None], firsts: list[int], mask_table: MaskTable | None = None):
    """The logits with -inf where an entry's mask forbids a token (a copy; the same logits when no entry has a
    mask). The masks come from mask_table, where each crossed to the device once (without one, they are sent
    whole). A structured output never verifies proposals (the scheduler does not speculate for it): its one row
    is its first."""
    entries = [i for i, s in enumerate(samplings) if s is not None and s.allowed is not None]
    if not entries:
        return logits
    xp, rows = array_module(logits), [firsts[i] for i in entries]
    masked = logits.copy()
    masks = [samplings[i].allowed for i in entries]
    allowed = mask_table.gather(masks, xp) if mask_table else xp.asarray(np.stack(masks))
    masked[rows] = xp.where(allowed, logits[rows], -xp.inf)
    return masked


def step_logprobs(logits, samplings: list[Sampling | None], tokens: list[list[int]], firsts: list[int],
                  errors: dict[int, Exception]) -> list[list[tuple] | None]:
    """For the entries that asked, from ONE log-softmax over the rows of their emitted ids in the raw logits: per
    id (its logprob, its rank, the top ids, their logprobs), on the host. A failure fails every entry in the batch."""
    out: list[list[tuple] | None] = [None] * len(samplings)
    asked = [i for i, s in enumerate(samplings) if s is not None and s.params.logprobs is not None
             and i not in errors]
    if not asked:
        return out
    rows = [firsts[i] + j for i in asked for j in range(len(tokens[i]))]
    try:
        k = max(samplings[i].params.logprobs for i in asked)
        emitted = [t for i in asked for t in tokens[i]]
        top, values, chosen, ranks = (to_host(a) for a in raw_logprobs(logits[rows], emitted, k))
    except Exception as e:   # a batch operation: every entry in it fails, the other entries go on
        errors.update({i: e for i in asked})
        return out
    r = 0
    for i in asked:
        out[i] = [(chosen[r + j], ranks[r + j], top[r + j], values[r + j]) for j in range(len(tokens[i]))]
        r += len(tokens[i])
    return out


def is_plain_greedy(params) -> bool:
    return params.temperature == 0 and not params.has_penalties


def to_host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()
