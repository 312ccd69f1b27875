"""Chapter 1 checkpoint: the default model's forward pass, stage by stage, checked against transformers.

    make chapter-1                  # python -m chapters 1
    make chapter-1 IMPL=student     # the same, with your exercises.py functions inside the engine

Every engine function is called through its module (`reference.rms_norm`, not a local import), so the
student's functions, plugged into `tinyvllm.reference` by `python -m chapters 1 --impl student`, run here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tinyvllm import reference
from tinyvllm.formats import config, tokenizer
from tinyvllm.formats.checkpoints import resolve_model
from tinyvllm.model import weights

PROMPT = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": PROMPT}]
MAX_NEW_TOKENS = 24
TOLERANCE = 1e-4  # relative error vs transformers, both float32: the design's bar for the oracle


@dataclass
class Loaded:
    model_dir: object
    cfg: config.LlamaConfig
    tok: tokenizer.Tokenizer
    model: reference.ReferenceModel
    nbytes: int


def load(model: str = "default") -> Loaded:
    """Config, float32 weights in one blob, tokenizer, and the NumPy reference model on top of them."""
    model_dir = resolve_model(model)
    cfg = config.load_config(model_dir)
    w = weights.load_weights(model_dir, cfg)
    return Loaded(model_dir, cfg, tokenizer.load_tokenizer(model_dir), reference.ReferenceModel(cfg, w.views),
                  w.nbytes)


# ---- one forward pass, cut into the stages of the chapter's map ----

def embed(model: reference.ReferenceModel, ids: list[int]) -> np.ndarray:
    """Token ids (T,) -> rows of the embedding table (T, hidden): a lookup, no arithmetic."""
    return model.w["model.embed_tokens.weight"][np.asarray(ids)]


def qkv(model: reference.ReferenceModel, i: int, x: np.ndarray, cos: np.ndarray, sin: np.ndarray):
    """Layer i: RMSNorm, then Q (T, H, d), K and V (T, KVH, d), with RoPE applied to Q and K."""
    return model.project_qkv(i, x, cos, sin)


def attention_block(model: reference.ReferenceModel, i: int, x: np.ndarray, cos, sin) -> np.ndarray:
    """Layer i's attention output after o_proj (T, hidden); the caller adds it to the residual."""
    return model.attention_block(i, *qkv(model, i, x, cos, sin))


def mlp_block(model: reference.ReferenceModel, i: int, x: np.ndarray) -> np.ndarray:
    """Layer i's RMSNorm + SwiGLU MLP (T, hidden): up to intermediate_size and back down."""
    return model.mlp_block(i, x)


def layer(model: reference.ReferenceModel, i: int, x: np.ndarray, cos, sin) -> np.ndarray:
    x = x + attention_block(model, i, x, cos, sin)
    return x + mlp_block(model, i, x)


def lm_head(model: reference.ReferenceModel, x: np.ndarray) -> np.ndarray:
    """Final RMSNorm, then one score per vocabulary entry (T, vocab)."""
    return model.lm_head_logits(x)


def attention_probs(model: reference.ReferenceModel, ids: list[int], layer_index: int, head: int) -> np.ndarray:
    """The (T, T) attention probabilities of one query head in one layer, for the notebook's heat map."""
    cos, sin = reference.rope_cos_sin(model.inv_freq, np.arange(len(ids)))
    x = embed(model, ids)
    for i in range(layer_index):
        x = layer(model, i, x, cos, sin)
    q, k, _ = qkv(model, layer_index, x, cos, sin)
    kv_head = head // (model.cfg.num_attention_heads // model.cfg.num_key_value_heads)
    scores = q[:, head] @ k[:, kv_head].T / np.float32(np.sqrt(model.cfg.head_dim))
    future = np.triu(np.ones((len(ids), len(ids)), dtype=bool), k=1)
    return reference.softmax(np.where(future, np.float32(-np.inf), scores))


def generate(model: reference.ReferenceModel, ids: list[int], max_new_tokens: int, stop_ids) -> dict:
    """Greedy decoding with the KV cache: one prefill of the prompt, then one token per forward."""
    cache = model.new_cache(len(ids) + max_new_tokens)
    start = time.perf_counter()
    logits = model.forward(ids, cache, all_logits=False)
    prefill_s, prefill_logits, tokens = time.perf_counter() - start, logits, []
    start = time.perf_counter()
    while len(tokens) < max_new_tokens:
        tokens.append(int(np.argmax(logits)))
        if tokens[-1] in stop_ids or len(tokens) == max_new_tokens:
            break
        logits = model.forward([tokens[-1]], cache, all_logits=False)  # T=1: reads K/V of all earlier tokens
    return dict(tokens=tokens, prefill_logits=prefill_logits, prefill_s=prefill_s,
                decode_s=time.perf_counter() - start, cache_len=cache.length)


# ---- the independent reference: transformers' LlamaForCausalLM, torch float32 on the CPU ----

def transformers_outputs(model_dir, ids: list[int], generated: list[int]) -> dict | str:
    """The same stages from HF transformers (forward hooks), or why they could not be computed."""
    try:
        import torch
        import transformers
        from transformers import AutoTokenizer, LlamaForCausalLM
    except ImportError as e:
        return f"skipped: {e.name} is not installed (make test installs torch and transformers)"
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    hf_ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_dict=False)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    captured = {}

    def keep(name):
        return lambda module, args, out: captured.update({name: (out[0] if isinstance(out, tuple) else out)[0]})

    modules = {"embed": hf.model.embed_tokens, "attn0": hf.model.layers[0].self_attn,
               "layer0": hf.model.layers[0], "layers": hf.model.layers[-1]}
    hooks = [m.register_forward_hook(keep(name)) for name, m in modules.items()]
    with torch.no_grad():  # prompt + our answer in one pass: position t's logits predict token t+1
        logits = hf(torch.tensor([ids + generated[:-1]])).logits[0]
    for h in hooks:
        h.remove()
    return {"ids": list(hf_ids), "logits": logits.numpy(), **{k: v.numpy() for k, v in captured.items()}}


# ---- the verdict table ----

@dataclass
class Stage:
    name: str
    output: str
    seconds: float
    check: str = "-"
    ok: bool | None = None  # None: nothing to check, or the check was skipped


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def compare(out: np.ndarray, ref: np.ndarray) -> tuple[str, bool]:
    if out.dtype != np.float32:
        return f"dtype {out.dtype}, expected float32", False
    if out.shape != ref.shape:
        return f"shape {out.shape}, transformers {ref.shape}", False
    err = rel_err(out, ref)
    return f"rel err {err:.1e}", bool(err < TOLERANCE)


def shape(a: np.ndarray) -> str:
    return f"{tuple(a.shape)} {a.dtype}".replace("float32", "f32")


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def print_table(stages: list[Stage], reference_name: str) -> None:
    print(f"{'stage':<24} {'output':<24} {'time':>9}   check vs {reference_name}")
    for s in stages:
        verdict = {True: "ok", False: "FAIL", None: ""}[s.ok]
        print(f"{s.name:<24} {s.output:<24} {s.seconds * 1e3:>6.0f} ms   {s.check:<44} {verdict}")


def run_stages(m: Loaded) -> tuple[list[int], dict, dict, list[Stage]]:
    """Tokenize, then the forward pass one stage at a time, then greedy generation; every step timed."""
    cfg, model = m.cfg, m.model
    ids, t_tok = timed(m.tok.apply_chat_template, MESSAGES)
    cos, sin = reference.rope_cos_sin(model.inv_freq, np.arange(len(ids)))
    x_embed, t_embed = timed(embed, model, ids)
    attn0, t_attn0 = timed(attention_block, model, 0, x_embed, cos, sin)
    x_attn0 = x_embed + attn0  # the residual connection: attention adds to the stream, never replaces it
    mlp0, t_mlp0 = timed(mlp_block, model, 0, x_attn0)
    x, t_layers = x_attn0 + mlp0, t_attn0 + t_mlp0
    out = {"embed": x_embed, "attn0": attn0, "layer0": x}
    for i in range(1, cfg.num_hidden_layers):
        x, dt = timed(layer, model, i, x, cos, sin)
        t_layers += dt
    out["layers"] = x
    out["logits"], t_head = timed(lm_head, model, x)
    gen = generate(model, ids, MAX_NEW_TOKENS, set(m.tok.stop_token_ids) | set(cfg.eos_token_ids))
    stages = [
        Stage("tokenize", f"{len(ids)} ids", t_tok),
        Stage("embed", shape(x_embed), t_embed),
        Stage("layer 0 attention", shape(attn0), t_attn0),
        Stage("layer 0 MLP", shape(out["layer0"]), t_mlp0),
        Stage(f"all {cfg.num_hidden_layers} layers", shape(x), t_layers),
        Stage("final norm + lm_head", shape(out["logits"]), t_head),
        Stage("prefill (engine forward)", shape(gen["prefill_logits"]), gen["prefill_s"]),
        Stage("decode (KV cache)", f"{len(gen['tokens'])} tokens, cache {gen['cache_len']}", gen["decode_s"]),
    ]
    return ids, out, gen, stages


def check_with_transformers(stages: list[Stage], ids: list[int], out: dict, gen: dict, hf: dict) -> None:
    """Fill in each stage's check from transformers' outputs (which also ran our answer's tokens)."""
    n, hf_prompt = len(ids), hf["logits"][:len(ids)]
    stages[0].check, stages[0].ok = ("ids identical" if ids == hf["ids"] else "ids differ"), ids == hf["ids"]
    for stage, name in zip(stages[1:5], ("embed", "attn0", "layer0", "layers")):
        stage.check, stage.ok = compare(out[name], hf[name][:n])
    check, ok = compare(out["logits"], hf_prompt)
    agree = int(np.sum(out["logits"].argmax(-1) == hf_prompt.argmax(-1)))
    last_ok = bool(out["logits"][-1].argmax() == hf_prompt[-1].argmax())  # the one that picks the next token
    stages[5].check, stages[5].ok = f"{check}, argmax {agree}/{n} positions", ok and last_ok
    stages[6].check, stages[6].ok = compare(gen["prefill_logits"], hf_prompt[-1])
    hf_greedy = hf["logits"][n - 1:].argmax(-1).tolist()  # teacher-forced: its choice after each prefix
    same = sum(a == b for a, b in zip(gen["tokens"], hf_greedy))
    stages[7].check = f"{same}/{len(gen['tokens'])} tokens = transformers' greedy"
    stages[7].ok = same == len(gen["tokens"])


def check_without_transformers(stages: list[Stage], out: dict, gen: dict) -> None:
    for stage in stages:
        stage.check = "skipped"
    check, stages[6].ok = compare(gen["prefill_logits"], out["logits"][-1])  # the engine agrees with the stages
    stages[6].check = f"vs the stages above: {check}"


def main() -> bool:
    start = time.perf_counter()
    m, load_s = timed(load)
    cfg = m.cfg
    print(f"model: {m.model_dir}\n  {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads of {cfg.head_dim}, "
          f"FFN {cfg.intermediate_size}, vocab {cfg.vocab_size}; {m.nbytes / 1e6:.0f} MB of float32 weights "
          f"loaded in {load_s:.1f} s\nprompt: {PROMPT!r} (chat template applied)\n")
    ids, out, gen, stages = run_stages(m)
    tokens = gen["tokens"]
    answer = m.tok.decode([t for t in tokens if t not in m.tok.stop_token_ids and t not in cfg.eos_token_ids])
    hf = transformers_outputs(m.model_dir, ids, tokens)
    if isinstance(hf, str):
        print(f"transformers check {hf}\n")
        check_without_transformers(stages, out, gen)
    else:
        check_with_transformers(stages, ids, out, gen, hf)
    stages.append(Stage("answer", f"{len(answer)} chars", 0.0, "contains 'Paris'", "Paris" in answer))

    print_table(stages, "HF transformers LlamaForCausalLM (torch float32, CPU)")
    per_token = gen["decode_s"] / max(len(tokens) - 1, 1)  # the first token came from the prefill
    print(f"\nanswer: {answer!r}\n{len(tokens)} tokens; decode {per_token * 1e3:.0f} ms/token; "
          f"total {time.perf_counter() - start:.1f} s")
    ok = all(s.ok is not False for s in stages)
    print("checkpoint 1:", "PASSED" if ok else "FAILED")
    return ok
