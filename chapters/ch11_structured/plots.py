"""Chapter 11 figures (`make figures`; the notebook calls the same functions): the DFA of a small regex, drawn
from the engine's own compile_dfa, and one step's distribution over the vocabulary before and after a JSON
schema's token mask, from the default model's logits."""
from __future__ import annotations


import numpy as np
from matplotlib.figure import Figure  # no pyplot: the same code draws for files (Agg) and notebooks
from matplotlib.patches import Circle, FancyArrowPatch

from tinyvllm.engine.structured.dfa import DEAD, DFA, compile_dfa
from tinyvllm.engine.structured.regex_parser import parse_regex

SMALL_REGEX = "(ab|a)*b"
# the step drawn in the masked-distribution figure: the reply so far, under this schema
MASK_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "population": {"type": "integer"}, "capital": {"type": "boolean"}},
               "required": ["city", "population", "capital"]}
MASK_PROMPT = "Give one French city as JSON with the keys city, population and capital."
MASK_PREFIX = '{"city": "Paris", "population": 2100000, "capital": '
TOP = 12


def byte_label(values: list[int]) -> str:
    """A set of bytes as a regex class: 'a', '[a-c]', '[ab]'."""
    runs, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            runs.append((start, v))
            start = None
    text = "".join(chr(a) if a == b else f"{chr(a)}{chr(b)}" if b == a + 1 else f"{chr(a)}-{chr(b)}" for a, b in runs)
    return text if len(values) == 1 else f"[{text}]"


def edges(dfa: DFA) -> dict[tuple[int, int], str]:
    """(from, to) -> the label of the bytes that move from one live state to the other."""
    out = {}
    for s in range(dfa.num_states):
        if s == DEAD:
            continue
        for t in sorted(set(dfa.transitions[s].tolist()) - {DEAD}):
            out[(s, t)] = byte_label(np.flatnonzero(dfa.transitions[s] == t).tolist())
    return out


def draw_dfa(pattern: str = SMALL_REGEX) -> Figure:
    """The live states of a regex's DFA in a row (start on the left), double circles where it accepts; every byte
    not drawn leads to the dead state."""
    dfa = compile_dfa(parse_regex(pattern))
    order, seen = [dfa.start], {dfa.start}                    # breadth-first from the start: left to right
    for s in order:
        for t in dfa.transitions[s].tolist():
            if t != DEAD and t not in seen:
                seen.add(t)
                order.append(t)
    x = {s: 2.2 * i for i, s in enumerate(order)}
    fig = Figure(figsize=(2.4 * len(order) + 1.5, 3.2))
    ax = fig.add_subplot()
    for s in order:
        ax.add_patch(Circle((x[s], 0), 0.42, facecolor="#DDE7F3", edgecolor="black", lw=1.4, zorder=2))
        if dfa.accepting[s]:
            ax.add_patch(Circle((x[s], 0), 0.34, facecolor="none", edgecolor="black", lw=1.2, zorder=3))
        ax.text(x[s], 0, str(order.index(s)), ha="center", va="center", fontsize=12, zorder=4)
    ax.annotate("", xy=(x[dfa.start] - 0.43, 0), xytext=(x[dfa.start] - 1.2, 0),
                arrowprops=dict(arrowstyle="-|>", lw=1.4))
    ax.text(x[dfa.start] - 1.25, 0.12, "start", ha="right", va="bottom", fontsize=9)
    for (s, t), label in edges(dfa).items():
        if s == t:                                            # a self-loop: an arc above the state
            ax.add_patch(FancyArrowPatch((x[s] - 0.2, 0.38), (x[s] + 0.2, 0.38), connectionstyle="arc3,rad=-1.6",
                                         arrowstyle="-|>", mutation_scale=12, lw=1.2))
            ax.text(x[s], 0.95, label, ha="center", va="bottom", fontsize=11, family="monospace")
            continue
        forward = x[t] > x[s]
        rad = -0.35 if forward else -0.45
        ax.add_patch(FancyArrowPatch((x[s], 0), (x[t], 0), connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>",
                                     mutation_scale=12, lw=1.2, shrinkA=16, shrinkB=16))
        height = abs(x[t] - x[s]) * (0.17 if forward else 0.23)
        ax.text((x[s] + x[t]) / 2, height + 0.05 if forward else -height - 0.05, label, ha="center",
                va="bottom" if forward else "top", fontsize=11, family="monospace")
    ax.set_xlim(min(x.values()) - 1.6, max(x.values()) + 0.8)
    ax.set_ylim(-1.3, 1.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"the DFA of {pattern!r}: {len(order)} live states (double circle: accepting); "
                 "every other byte leads to the dead state", fontsize=10)
    return fig


def masked_step(prefix: str = MASK_PREFIX, schema: dict = MASK_SCHEMA, prompt: str = MASK_PROMPT):
    """One decode step of the default model on the CPU, in the middle of a reply under `schema`: the logits of the
    next token after the chat prompt and `prefix`, the engine's mask for the DFA state `prefix` leads to, and the
    tokenizer. Returns (logits (vocab,), allowed (vocab,) bool, tokenizer)."""
    from tinyvllm.engine.block_manager import BlockManager, plan_prefill
    from tinyvllm.engine.structured.compiler import StructuredOutputCompiler
    from tinyvllm.engine.structured.params import StructuredOutputsParams
    from tinyvllm.formats.checkpoints import resolve_model
    from tinyvllm.formats.tokenizer import load_tokenizer
    from tinyvllm.model.kv_pool import PagedKVPool
    from tinyvllm.model.model import Model
    from tinyvllm.model.prefill import prefill_batch

    model_dir = resolve_model("default")
    tok = load_tokenizer(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}]) + tok.encode(prefix)
    model = Model(model_dir, "cpu", len(ids) + 16)
    blocks = len(ids) // 16 + 2
    logits = np.asarray(prefill_batch(model, PagedKVPool(model.cfg, model.ops, blocks),
                                      [plan_prefill(BlockManager(blocks), 0, ids)])[0], np.float64)
    token_dfa = StructuredOutputCompiler(tok.token_bytes, model.cfg.vocab_size).compile(StructuredOutputsParams(json=schema))
    state = token_dfa.dfa.walk(token_dfa.dfa.start, prefix.encode())
    return logits, token_dfa.allowed(state, frozenset(tok.stop_token_ids)), tok


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits[np.isfinite(logits)].max())
    return e / e.sum()


def draw_masked_distribution(step=None, top: int = TOP) -> Figure:
    """The next token's probabilities (temperature 1) before the mask, and after it: forbidden logits set to -inf,
    the softmax taken again. `step`: masked_step()'s result (computed when None)."""
    logits, allowed, tok = step if step is not None else masked_step()
    before = softmax(logits)
    after = softmax(np.where(allowed, logits, -np.inf))
    fig = Figure(figsize=(12, 4.2))
    for ax, probs, title in ((fig.add_subplot(1, 2, 1), before, "before the mask: the model's distribution"),
                             (fig.add_subplot(1, 2, 2), after, f"after the mask: {int(allowed.sum()):,} of "
                                                                f"{len(allowed):,} tokens allowed")):
        ids = [i for i in np.argsort(-probs) if probs[i] > 0][:top]
        colors = ["#55A868" if allowed[i] else "#C44E52" for i in ids]
        ax.bar(range(len(ids)), probs[ids], color=colors)
        ax.set_xticks(range(len(ids)), [repr(tok.decode([int(i)]))[1:-1] or "∅" for i in ids], rotation=60,
                      fontsize=9, family="monospace")
        ax.set_ylabel("probability")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, 1.05)
    fig.suptitle(f"the next token after {MASK_PREFIX!r} (green: the schema allows it, red: masked to -inf)",
                 fontsize=10)
    fig.tight_layout()
    return fig


FIGURES = {
    "ch11_dfa.png": draw_dfa,
    "ch11_masked_distribution.png": draw_masked_distribution,
}
