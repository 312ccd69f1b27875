"""Chapter 7, serving: the response to one HTTP request, built from its RequestStates — whole, as one JSON
reply once every choice has finished, or as server-sent events while the tokens arrive.

The events are the API process's hot loop (at 128 streams x 150 steps a second, one per token per client):
a piece of text is spliced into a template made once per choice, and a wake-up writes once for all its choices.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request

from tinyvllm.entrypoints import openai_protocol as api
from tinyvllm.entrypoints import tool_parsers, tools
from tinyvllm.entrypoints.async_engine import SHUTTING_DOWN, AsyncEngine, RequestState
from tinyvllm.formats.tokenizer import Tokenizer


class Reply:
    """Builds one HTTP request's response from its choices: whole (JSON) or as server-sent events."""
    def __init__(self, request_id: str, model: str, chat: bool, body, choices: list[RequestState],
                 tokenizer: Tokenizer):
        self.request_id, self.model, self.chat, self.body, self.choices = request_id, model, chat, body, choices
        self.tokenizer = tokenizer
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"   # OpenAI's names
        self.created = int(time.time())   # one time for every chunk of a response, as OpenAI's
        self.top_k = getattr(body, "top_logprobs", None) or 0
        self.echo = [tokenizer.decode(c.prompt_ids) if getattr(body, "echo", False) else "" for c in choices]
        self.offsets = [len(e) for e in self.echo]   # where each choice's next text starts (completion logprobs)
        self.text_events = [self._text_event(c.index) for c in choices]
        # with tools, the reply is parsed for calls in this format (None: plain text)
        self.tool_format = tools.reply_format(tokenizer, body.tool_dicts, body.tool_choice_value) if chat else None
        self.held = [HeldCalls(self.tool_format) for _ in choices] if self.tool_format and body.stream else None

    def usage(self) -> dict:
        prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in self.choices}   # n choices share one prompt
        return api.usage(sum(prompts.values()), sum(len(c.token_ids) for c in self.choices))

    def logprobs(self, choice: RequestState, text: str, ids: list[int], entries: list[dict] | None) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return api.chat_logprobs(ids, entries, self.top_k, self.tokenizer)
        out = api.completion_logprobs(ids, entries, self.offsets[choice.index], self.tokenizer)
        self.offsets[choice.index] += len(text)
        return out

    def whole(self) -> dict:
        choices = []
        for c in self.choices:
            text = c.final_text()
            logprobs = self.logprobs(c, text, c.token_ids, c.logprobs)
            if self.chat:
                choices.append(self._chat_choice(c, text, logprobs))
            else:
                choices.append(api.completion_choice(c.index, self.echo[c.index] + text, logprobs, c.finish_reason))
        return api.response(self.request_id, self.object, self.model, choices, self.usage(), self.created)

    def _chat_choice(self, choice: RequestState, text: str, logprobs: dict | None) -> dict:
        if self.tool_format is None:
            return api.chat_choice(choice.index, text, logprobs, choice.finish_reason)
        content, calls = tool_parsers.parse(text, self.tool_format)
        return api.chat_choice(choice.index, content, logprobs, "tool_calls" if calls else choice.finish_reason,
                               [call.openai() for call in calls])

    def _chunk_data(self, index: int, text: str | None, logprobs: dict | None, finish_reason: str | None) -> dict:
        if self.chat:
            return self._delta_data(index, {} if text is None else {"content": text}, logprobs, finish_reason)
        data = api.completion_choice(index, text or "", logprobs, finish_reason)
        out = api.response(self.request_id, self.chunk_object, self.model, [data], created=self.created)
        return {**out, "usage": None} if self.body.include_usage else out

    def _delta_data(self, index: int, delta: dict, logprobs: dict | None, finish_reason: str | None) -> dict:
        data = api.chat_delta_choice(index, delta, logprobs, finish_reason)
        out = api.response(self.request_id, self.chunk_object, self.model, [data], created=self.created)
        return {**out, "usage": None} if self.body.include_usage else out

    def _text_event(self, index: int) -> tuple[str, str]:
        """A text chunk's event split around its text: each token's event is then a splice, not a JSON
        dump of nested dicts (at 128 streams x 150 steps a second, that is the API process's hot loop)."""
        head, tail = event(self._chunk_data(index, TEXT, None, None)).split(json.dumps(TEXT), 1)
        return head, tail

    def chunk(self, choice: RequestState, text: str | None, ids: list[int], entries, finish_reason) -> str:
        if text is not None and entries is None and finish_reason is None:
            head, tail = self.text_events[choice.index]
            return head + sse_json(text) + tail
        logprobs = self.logprobs(choice, text or "", ids, entries)
        return event(self._chunk_data(choice.index, text, logprobs, finish_reason))

    def streamed_text(self, choice: RequestState, text: str) -> str:
        """The part of new text to send now: with tools, what may be a call waits for the end (HeldCalls)."""
        return text if self.held is None else self.held[choice.index].feed(text)

    def last_chunks(self, choice: RequestState) -> str:
        """A finished choice's last events: with tools, the held text as content and calls, then the finish."""
        out, reason = "", choice.finish_reason
        if self.held is not None:
            content, calls = self.held[choice.index].finish()
            if content:
                out += self.chunk(choice, content, [], None, None)
            if calls:
                delta = {"tool_calls": [{"index": i, **call.openai()} for i, call in enumerate(calls)]}
                out += event(self._delta_data(choice.index, delta, None, None))
                reason = "tool_calls"
        return out + self.chunk(choice, None, [], None, reason)

    def first_chunks(self) -> str:
        if self.chat:   # the first chat chunk of each choice names the role
            return "".join(event(api.response(self.request_id, self.chunk_object, self.model,
                                              [api.chat_delta_choice(c.index, {"role": "assistant", "content": ""},
                                                                     None, None)], created=self.created))
                           for c in self.choices)
        return "".join(self.chunk(c, self.echo[c.index], [], None, None) for c in self.choices if self.echo[c.index])

    def usage_chunk(self) -> str:
        return event({**api.response(self.request_id, self.chunk_object, self.model, [], created=self.created),
                      "usage": self.usage()})


class HeldCalls:
    """One streaming choice's text, held back from where a tool call may begin until the choice ends; then the
    rest is parsed whole and its calls sent in one tool_calls delta, arguments complete. (vLLM streams the
    arguments as they are generated; one delta at the end is as valid for OpenAI's clients, which join the
    deltas, and cannot send a call that later turns out not to be one.)"""
    def __init__(self, format_: str):
        self.parser, self.text, self.sent = tool_parsers.PARSERS[format_], "", 0

    def feed(self, text: str) -> str:
        self.text += text
        end = max(self.sent, self.parser.content_end(self.text))
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str | None, list[tool_parsers.ToolCall]]:
        return self.parser.parse(self.text[self.sent:])


TEXT = "\x00text\x00"   # a placeholder no JSON dump leaves unescaped


def event(data) -> str:
    return f"data: {sse_json(data)}\n\n"


# JSON leaves U+0085, U+2028 and U+2029 as they are, and SSE allows them, but Python's str.splitlines() ends a
# line at each: httpx's line reader (so the openai client) cut an event in two, and its JSON did not parse
LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(data) -> str:
    """One event's JSON: UTF-8 as it is (no \\uXXXX for every accent), except the characters that end a line."""
    return json.dumps(data, ensure_ascii=False).translate(LINE_BREAKS_JSON_KEEPS)


async def stream_events(engine: AsyncEngine, reply: Reply) -> AsyncIterator[str]:
    """Server-sent events: the text of each choice as it arrives (whatever came since the last event, in one
    chunk: a slow client gets bigger chunks, not a growing queue), then each choice's finish reason, the
    usage if asked, and `data: [DONE]`. One write per wake-up. Cancelled when the client goes away: its
    choices are aborted."""
    choices, wake = reply.choices, reply.choices[0].wake
    try:
        first = reply.first_chunks()
        if first:
            yield first
        open_ = list(choices)
        while open_:
            await wake.wait()
            wake.clear()
            events = []
            for choice in list(open_):
                text, ids, entries = choice.take()
                if choice.finish_reason == "error":
                    message = choice.error if choice.error == SHUTTING_DOWN else \
                        f"the request failed in the engine: {choice.error}"
                    error = api.error(message, "server_error")
                    yield "".join(events) + event(error) + "data: [DONE]\n\n"
                    return
                text = reply.streamed_text(choice, text)
                if text or entries:   # a stop token alone is no text: nothing to send but the finish
                    events.append(reply.chunk(choice, text, ids, entries, None))
                if choice.finished:
                    events.append(reply.last_chunks(choice))
                    open_.remove(choice)
            if not open_:
                events += [reply.usage_chunk()] if reply.body.include_usage else []
                events.append("data: [DONE]\n\n")
            if events:
                yield "".join(events)
    finally:   # finished: a no-op; the client left (cancelled here): its choices stop now
        engine.abort(choices)


async def until_finished(request: Request, choices: list[RequestState]) -> None:
    """Wait for every choice to finish, or for the client to leave (then raise: nobody will read it)."""
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while not all(c.finished for c in choices):
            woken = asyncio.ensure_future(choices[0].wake.wait())
            done, _ = await asyncio.wait({woken, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                woken.cancel()
                raise ClientGone()
            choices[0].wake.clear()
    finally:
        gone.cancel()


class ClientGone(Exception):
    """The client closed the connection: there is nobody to answer."""


async def disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body is read, so only that message can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
