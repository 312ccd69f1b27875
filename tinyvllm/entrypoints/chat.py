"""`python -m tinyvllm chat`: a conversation in the terminal, one line per user turn.

Each turn appends the user's line to the conversation, renders the whole conversation with the model's
chat template, streams the reply as it is generated, and appends the reply, so the next turn's prompt
holds everything said so far. The model itself remembers nothing between calls: the history is resent
(and prefilled again) every turn. When it outgrows the context window, the oldest user/assistant turns
are dropped; the system prompt always stays.

Commands: /reset forgets the conversation, /exit (or Ctrl-D) quits. Ctrl-C stops a reply early and
keeps what was said; Ctrl-C at the prompt quits.
"""
from __future__ import annotations

import sys
from typing import TextIO

from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.entrypoints.llm import LLM, CompletionOutput, RequestOutput
from tinyvllm.errors import TinyVLLMError

HELP = "commands: /reset (forget the conversation, keep the system prompt), /exit (quit; Ctrl-D also quits)"


def run_chat(llm: LLM, params: SamplingParams, system: str | None, stdin: TextIO, stdout: TextIO,
             stderr: TextIO | None = None) -> None:
    """Read user lines from stdin until /exit, end of input or Ctrl-C; stream each reply to stdout."""
    stderr = stderr or sys.stderr
    preamble = [{"role": "system", "content": system}] if system else []
    history: list[dict] = []  # user and assistant messages, alternating
    if stdin.isatty():
        print(HELP, file=stdout)
    while True:
        try:
            line = read_line(stdin, stdout)
        except KeyboardInterrupt:  # Ctrl-C at the prompt quits
            print(file=stdout)
            return
        if line is None or line == "/exit":
            return
        if not line:
            continue
        if line == "/reset":
            history = []
            print("(conversation cleared" + ("; system prompt kept)" if system else ")"), file=stdout)
            continue
        if line.split()[0].startswith("/"):
            print(HELP, file=stdout)
            continue
        turns = history + [{"role": "user", "content": line}]
        try:
            prompt_ids = fit_to_window(llm, preamble, turns, reply_room(llm, params))
            reply = stream_reply(llm, prompt_ids, params, stdout)
        except TinyVLLMError as e:  # this turn failed; the conversation so far is kept as it was
            print(f"error: {e}", file=stderr)
            continue
        history = turns + [{"role": "assistant", "content": reply}]


def read_line(stdin: TextIO, stdout: TextIO) -> str | None:
    """The next line the user typed, without its newline and outer spaces; None at end of input."""
    tty = stdin.isatty()  # only a person at a terminal needs a prompt; piped input gets clean output
    if tty:
        stdout.write("> ")
        stdout.flush()
    line = stdin.readline()
    if not line and tty:  # Ctrl-D: end the "> " line before the shell prints its own prompt
        print(file=stdout)
    return line.strip() if line else None


def reply_room(llm: LLM, params: SamplingParams) -> int:
    """Tokens kept free for the reply: max_tokens, but at most half the window so history still fits."""
    half = llm.max_model_len // 2
    return min(params.max_tokens or half, half)


def fit_to_window(llm: LLM, preamble: list[dict], turns: list[dict], room: int) -> list[int]:
    """Prompt ids for preamble + turns, dropping the oldest turns (in place) until `room` tokens are left."""
    while True:
        ids = llm.tokenizer.apply_chat_template(preamble + turns)
        if len(ids) + room <= llm.max_model_len:
            return ids
        if len(turns) == 1:  # only the new message is left, and it alone is too long
            raise TinyVLLMError(f"this message makes a {len(ids)}-token prompt; with {room} tokens for the reply "
                                f"the context window ({llm.max_model_len}) is full; send a shorter message")
        del turns[:2]  # the oldest user message and its reply


def stream_reply(llm: LLM, prompt_ids: list[int], params: SamplingParams, stdout: TextIO) -> str:
    """Print the reply as it is generated and return its text; Ctrl-C ends it early, keeping the text so far."""
    out = RequestOutput(None, prompt_ids, [CompletionOutput()])
    try:
        for text in llm.stream(prompt_ids, params, out):
            stdout.write(text)
            stdout.flush()
    except KeyboardInterrupt:
        pass  # out.text already holds every chunk printed so far
    print(file=stdout)
    return out.text
