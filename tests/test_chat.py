"""`python -m tinyvllm chat`: the REPL's prompts and replies against LLM.chat and the chat template."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyvllm.engine.sampling import SamplingParams
from tinyvllm.entrypoints.chat import run_chat
from tinyvllm.entrypoints.llm import LLM
from tinyvllm.errors import TinyVLLMError

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=8)
SYSTEM = "You are a terse assistant."


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def llm(default_model_dir) -> LLM:
    return LLM("default", device="cpu")


def reply(llm: LLM, messages: list[dict]) -> str:
    """The engine's own greedy answer to a whole conversation: what the REPL must print."""
    return llm.chat(messages, GREEDY)[0].text


def chat(llm: LLM, monkeypatch, lines: str, system: str | None = SYSTEM) -> tuple[list[list[int]], str, str]:
    """Drive the REPL with `lines` as stdin; returns the prompt ids of each turn, stdout and stderr."""
    prompts, real_stream = [], llm.stream

    def recording_stream(prompt_ids, params, out=None):
        prompts.append(list(prompt_ids))
        return real_stream(prompt_ids, params, out)

    monkeypatch.setattr(llm, "stream", recording_stream)
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        run_chat(llm, GREEDY, system, io.StringIO(lines), stdout, stderr)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the REPL instead of ending the reply")
    return prompts, stdout.getvalue(), stderr.getvalue()


def test_two_turns_resend_the_whole_history(llm, monkeypatch):
    system = {"role": "system", "content": SYSTEM}
    first = reply(llm, [system, user("What is 2+2?")])
    second = reply(llm, [system, user("What is 2+2?"), assistant(first), user("And times 3?")])
    prompts, out, err = chat(llm, monkeypatch, "What is 2+2?\n\nAnd times 3?\n")
    template = llm.tokenizer.apply_chat_template
    assert prompts == [template([system, user("What is 2+2?")]),
                       template([system, user("What is 2+2?"), assistant(first), user("And times 3?")])]
    assert out == f"{first}\n{second}\n"  # the empty line between them was ignored
    assert err == ""


def test_reset_keeps_only_the_system_prompt(llm, monkeypatch):
    prompts, out, _ = chat(llm, monkeypatch, "What is 2+2?\n/reset\nName a color.\n")
    system = {"role": "system", "content": SYSTEM}
    assert prompts[1] == llm.tokenizer.apply_chat_template([system, user("Name a color.")])
    assert out.splitlines()[1].startswith("(conversation cleared")


def test_exit_and_end_of_input_stop_the_loop(llm, monkeypatch):
    prompts, out, _ = chat(llm, monkeypatch, "Hi\n/exit\nThis is never read.\n")
    assert len(prompts) == 1 and out == reply(llm, [{"role": "system", "content": SYSTEM}, user("Hi")]) + "\n"
    assert chat(llm, monkeypatch, "") == ([], "", "")


def test_unknown_command_prints_the_commands(llm, monkeypatch):
    prompts, out, _ = chat(llm, monkeypatch, "/help\n")
    assert prompts == [] and len(out.splitlines()) == 1
    assert "/reset" in out and "/exit" in out


def test_ctrl_c_at_the_prompt_quits(llm):
    class CtrlC(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt
    try:
        run_chat(llm, GREEDY, None, CtrlC(), io.StringIO(), io.StringIO())
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C at the prompt should end the REPL quietly")


def test_ctrl_c_during_a_reply_keeps_what_was_said(llm, monkeypatch):
    real_stream = llm.stream

    def interrupted_stream(prompt_ids, params, out=None):
        for text in real_stream(prompt_ids, params, out):
            yield text
            if prompt_ids == first_prompt:  # the user presses Ctrl-C after the first chunk of the first reply
                raise KeyboardInterrupt

    system = {"role": "system", "content": SYSTEM}
    first_prompt = llm.tokenizer.apply_chat_template([system, user("Count to ten.")])
    chunk = next(real_stream(first_prompt, GREEDY))
    monkeypatch.setattr(llm, "stream", interrupted_stream)
    prompts, out, _ = chat(llm, monkeypatch, "Count to ten.\nThanks.\n")
    assert prompts[1] == llm.tokenizer.apply_chat_template(
        [system, user("Count to ten."), assistant(chunk), user("Thanks.")])
    assert out.startswith(chunk + "\n")


# ---------------------------------------------------------------- the context window

HI, JOKE = "Hi", "Tell me a joke."
MOON = "Describe the moon in one sentence."


@pytest.fixture(scope="module")
def small_window(llm) -> tuple[LLM, list[str]]:
    """An LLM whose window misses the three turns HI, JOKE, MOON by one token."""
    a1 = reply(llm, [user(HI)])
    a2 = reply(llm, [user(HI), assistant(a1), user(JOKE)])
    template = llm.tokenizer.apply_chat_template
    everything = [user(HI), assistant(a1), user(JOKE), assistant(a2), user(MOON)]
    window = len(template(everything)) + GREEDY.max_tokens - 1
    small = LLM("default", device="cpu", max_model_len=window)
    assert small.max_model_len == window
    return small, [a1, a2]


def test_a_full_window_drops_the_oldest_turns(small_window, monkeypatch):
    small, (a1, a2) = small_window
    prompts, out, err = chat(small, monkeypatch, f"{HI}\n{JOKE}\n{MOON}\n", system=None)
    template = small.tokenizer.apply_chat_template
    assert prompts == [template([user(HI)]),
                       template([user(HI), assistant(a1), user(JOKE)]),
                       template([user(JOKE), assistant(a2), user(MOON)])]  # the first turn is gone
    assert out.startswith(f"{a1}\n{a2}\n") and err == ""


def test_a_message_too_long_for_the_window_is_an_error_for_that_turn(small_window, monkeypatch):
    small, (a1, _) = small_window
    huge = "word " * small.max_model_len
    prompts, out, err = chat(small, monkeypatch, f"{HI}\n{huge}\n{JOKE}\n", system=None)
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    template = small.tokenizer.apply_chat_template
    assert prompts == [template([user(HI)]), template([user(HI), assistant(a1), user(JOKE)])]  # history kept
    assert len(out.splitlines()) == 2


def test_an_engine_error_is_reported_and_the_loop_goes_on(llm, monkeypatch):
    def failing_stream(prompt_ids, params, out=None):
        raise TinyVLLMError("something is wrong; fix it")
        yield  # a generator, like LLM.stream

    monkeypatch.setattr(llm, "stream", failing_stream)
    stdout, stderr = io.StringIO(), io.StringIO()
    run_chat(llm, GREEDY, None, io.StringIO("Hi\nHi again\n/help\n"), stdout, stderr)
    assert stderr.getvalue() == "error: something is wrong; fix it\n" * 2
    assert "/reset" in stdout.getvalue()  # the loop read the lines after the errors


# ---------------------------------------------------------------- as a user runs it

def test_chat_command_answers_and_exits_cleanly(default_model_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-m", "tinyvllm", "chat", "--device", "cpu", "--temperature", "0",
                          "--max-tokens", "8"], input="What is 2+2?\n/exit\n", cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() and not run.stdout.startswith(">")  # piped stdin: the reply, no prompt decoration
