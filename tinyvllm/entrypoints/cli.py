"""`python -m tinyvllm ...`: generate, chat, serve, info, model-path, synth.

A mistake by the user (a bad path, a corrupt file, a bad flag value) prints one line and exits with
code 2; `--debug` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from tinyvllm.engine.engine_config import EngineConfig, with_speculative_config
from tinyvllm.errors import TinyVLLMError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit code 2, like ours
        raise TinyVLLMError(f"{message} (see python -m {self.prog} --help)")  # prog: "tinyvllm [command]"


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return int(text)


FLAG_TYPES = {"int | None": _positive_int, "int": _positive_int, "float": float, "str": str, "str | None": str}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """--the-name for every EngineConfig field, with its default and help text (engine_config.py says them), and
    vLLM's --speculative-config."""
    for f in fields(EngineConfig):
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"])
        else:
            parser.add_argument(flag, type=FLAG_TYPES[f.type], default=f.default, choices=meta["choices"],
                                help=meta["help"])
    parser.add_argument("--speculative-config", help="vLLM's form of the speculative flags, as JSON: "
                                                     '\'{"method": "ngram", "num_speculative_tokens": 4}\'')


def engine_config(args) -> EngineConfig:
    """The EngineConfig the command line asked for (--speculative-config folded into the speculative flags)."""
    settings = {name: getattr(args, name) for name in EngineConfig.names()}
    return EngineConfig(**with_speculative_config(settings, args.speculative_config))


def build_parser() -> argparse.ArgumentParser:
    # --debug is accepted before or after the command; SUPPRESS keeps a subcommand from resetting it
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
    parser = _Parser(prog="tinyvllm", description="A small vLLM for Llama models, for learning.", parents=[debug])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    # what builds an engine: shared by generate, chat and serve, one flag per EngineConfig field
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_flags(engine)

    gen = sub.add_parser("generate", parents=[debug, engine],
                         help="answer a prompt, streaming the text (several prompts: batched together)")
    gen.add_argument("prompt", nargs="*", help="one or more prompts")
    gen.add_argument("--file", help="a text file with one prompt per line (added after the PROMPT arguments)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=_positive_int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming")

    chat = sub.add_parser("chat", parents=[debug, engine], help="talk with the model, one line per turn (/reset, /exit)")
    chat.add_argument("--system", default=None, help="a system prompt, kept for the whole conversation")
    chat.add_argument("--max-tokens", type=_positive_int, default=512, help="longest reply, in tokens")
    chat.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    chat.add_argument("--top-p", type=float, default=0.9)
    chat.add_argument("--top-k", type=int, default=0)
    chat.add_argument("--seed", type=int, default=None)

    serve = sub.add_parser("serve", parents=[debug, engine],
                           help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    serve.add_argument("--host", default="127.0.0.1", help="0.0.0.0 listens on every interface")
    serve.add_argument("--port", type=_port, default=8000, help="0 picks a free port")
    serve.add_argument("--max-queue", type=_positive_int, default=256,
                       help="requests allowed to wait for a slot; past it a request gets 429")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 routes (or set TINYVLLM_API_KEY)")
    serve.add_argument("--ui", action=argparse.BooleanOptionalAction, default=True,
                       help="a live page at / that draws the KV pool, the queues and each step's batch")
    serve.add_argument("--api-server-count", type=_positive_int, default=None,
                       help="API-server processes in front of the one engine (HTTP, JSON and detokenizing "
                            "for many clients take more than one core); default: on a GPU one per two cores, "
                            "up to 8; on the CPU 1")

    info = sub.add_parser("info", parents=[debug],
                          help="the model's config and memory map (weights and buffers)")
    info.add_argument("--model", default="default")
    info.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                      help="whose plan to show: cpu holds float32, cuda holds bf16")
    info.add_argument("--max-num-batched-tokens", type=_positive_int,
                      help="a step's token budget, the rows the buffers hold (default: the engine's on that device)")
    info.add_argument("--num-blocks", type=_positive_int, help="KV cache pool size (default: sized from memory)")
    info.add_argument("--json", action="store_true")

    path = sub.add_parser("model-path", parents=[debug],
                          help="print a model's directory (converting the default model once)")
    path.add_argument("model", nargs="?", default="default")

    synth = sub.add_parser("synth", parents=[debug],
                           help="write a random-weight checkpoint shaped like a real model")
    synth.add_argument("--like", default="llama-3.2-1b")
    synth.add_argument("--out", required=True)
    synth.add_argument("--seed", type=int, default=0)
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate"):
        synth.add_argument(f"--{flag}", type=_positive_int, help=f"shrink: override the preset's {flag}")
    return parser


def build_llm(args):
    from tinyvllm.entrypoints.llm import LLM
    return LLM.from_config(engine_config(args))


def cmd_generate(args) -> None:
    from tinyvllm.engine.sampling import SamplingParams

    prompts = list(args.prompt) + (_read_prompts(args.file) if args.file else [])
    if not prompts:
        raise TinyVLLMError("give a prompt, or --file with one prompt per line (see python -m tinyvllm generate --help)")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    llm = build_llm(args)
    tok = llm.tokenizer
    ids = [tok.encode(p) if args.raw else tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    if len(prompts) == 1:
        return _stream_one(llm, prompts[0], ids[0], params, args.json)
    outputs = llm.generate(ids, params, use_tqdm=not args.json)  # all at once, through the scheduler
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        out.prompt = prompt
        if args.json:
            print(json.dumps(_as_json(out), ensure_ascii=False))
        else:
            print(f"### {i + 1}. {prompt}\n{out.text}\n")


def _stream_one(llm, prompt: str, prompt_ids: list[int], params, as_json: bool) -> None:
    from tinyvllm.entrypoints.llm import CompletionOutput, RequestOutput
    out = RequestOutput(prompt, prompt_ids, [CompletionOutput()])
    for text in llm.stream(prompt_ids, params, out):
        if not as_json:
            print(text, end="", flush=True)
    t = out.timings
    if as_json:
        print(json.dumps(_as_json(out), ensure_ascii=False))
    else:
        print(f"\n\n[{len(prompt_ids)} prompt tokens, first token after {t['time_to_first_token_s']:.2f} s, "
              f"{len(out.token_ids)} generated at {t['decode_tokens_per_s']:.1f} tokens/s, "
              f"finish: {out.outputs[0].finish_reason}]", file=sys.stderr)


def _as_json(out) -> dict:
    return {"text": out.text, "token_ids": out.token_ids, "prompt_token_ids": out.prompt_token_ids,
            "finish_reason": out.outputs[0].finish_reason, "timings": out.timings}


def _read_prompts(path: str) -> list[str]:
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise TinyVLLMError(f"cannot read --file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise TinyVLLMError(f"--file {path} is not UTF-8 text") from None
    return [line for line in lines if line.strip()]


def cmd_chat(args) -> None:
    from tinyvllm.engine.sampling import SamplingParams
    from tinyvllm.entrypoints.chat import run_chat

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    run_chat(build_llm(args), params, args.system, sys.stdin, sys.stdout, sys.stderr)


def cmd_serve(args) -> None:
    import logging
    import signal
    # Ctrl-C stops it, and so does `kill -INT` from a script, whose background jobs (`serve ... &`) start
    # with SIGINT ignored: Python would keep ignoring it
    signal.signal(signal.SIGINT, signal.default_int_handler)

    from tinyvllm.entrypoints.server import Server, announce
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = engine_config(args)
    from tinyvllm.entrypoints.api_servers import default_api_server_count, serve_many
    from tinyvllm.model.backend import resolve_device
    count = args.api_server_count or default_api_server_count(resolve_device(args.device))
    if count > 1:
        return serve_many(config, count, args.model, args.host, args.port, args.max_queue,
                          api_key=args.api_key, ui=args.ui)
    server = Server(config, args.model, args.host, args.port, args.max_queue, api_key=args.api_key, ui=args.ui)
    announce(args.model, server.engine.info, server.url, args.ui)
    server.serve()


def cmd_info(args) -> None:
    from tinyvllm.entrypoints.info import describe
    report, text = describe(args.model, args.device, args.max_num_batched_tokens, args.num_blocks)
    print(json.dumps(report, indent=2) if args.json else text)


def cmd_model_path(args) -> None:
    from tinyvllm.formats.checkpoints import resolve_model
    print(resolve_model(args.model))


def cmd_synth(args) -> None:
    from tinyvllm.formats.checkpoints import synth_model
    overrides = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                     num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                     intermediate_size=args.intermediate)
    print(synth_model(args.like, args.out, seed=args.seed, **overrides))


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "info": cmd_info,
            "model-path": cmd_model_path, "synth": cmd_synth}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        COMMANDS[args.command](args)
    except TinyVLLMError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head` closed our stdout: not an error
        sys.stderr.close()
        return 0
    return 0
