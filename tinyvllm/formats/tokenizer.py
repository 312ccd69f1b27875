"""Text <-> token ids for Llama 3 and SmolLM2, with tiktoken as the byte-pair-encoding engine.

Both families use byte-level BPE: text is split into pieces by one regex, and each piece's UTF-8
bytes are merged pairwise in rank order. A token's rank is its id, so tiktoken can run either vocab.

One idea, at some length: the tokenizer AND the reading of the files it comes from (tokenizer.json,
tokenizer_config.json, tiktoken ranks, the chat template), because each check names what is wrong in the
user's file; building those files from a GGUF is formats/gguf_convert.py's.
"""

import base64
import codecs
import json
import os
import re
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.meta
import regex
import tiktoken
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tinyvllm.errors import TinyVLLMError
from tinyvllm.formats.config import is_token_id, load_config, optional_file, read_json_object

# Meta's Llama 3 split regex: contractions, words, 1-3 digit groups, punctuation runs, whitespace.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's split regex, used by HF's ByteLevel pre-tokenizer.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# HF's Digits(individual_digits) + ByteLevel as one regex: each digit alone, and since the digit split
# happens first, a whitespace run before a digit ends its piece and is kept whole.
GPT2_DIGITS_PATTERN = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"
)

# Llama 3.1/3.2's chat format (Meta's template without tool calling), for Llama 3 models shipping none.
LLAMA3_CHAT_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: 26 Jul 2024\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Special tokens that end a turn besides eos, in the Llama 3 and ChatML formats.
_END_OF_TURN = ["<|eot_id|>", "<|eom_id|>", "<|im_end|>"]
# Meta's named Llama 3 special tokens, ids 128000-128010; reserved_special_token_2... fill the rest.
_LLAMA3_NAMED = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]
# A message content during chat rendering: a numbered private-use marker padded with U+3000 (a space
# that templates never write), so a missing pad shows that the template stripped the content.
_CONTENT_MARKER = re.compile("(\u3000?)\ue000(\\d+)\ue001(\u3000?)")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet of HF byte-level vocabs."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_UNICODE_TO_BYTE = {c: b for b, c in _byte_to_unicode().items()}


class Tokenizer:
    """Encodes text to ids and back, and renders chat conversations into prompt ids."""

    def __init__(self, ranks: dict[bytes, int], special_tokens: dict[str, int], pattern: str, *,
                 bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, name: str = "tokenizer", model_vocab_size: int | None = None,
                 source: str = "the tokenizer") -> None:
        """model_vocab_size: the model's vocabulary, when known; source: the file defining the special tokens."""
        self.special_tokens = special_tokens
        self._special_ids = set(special_tokens.values())
        self.model_vocab_size, self.source = model_vocab_size, source
        self.bos_token, self.eos_token, self.chat_template = bos_token, eos_token, chat_template
        self.bos_token_id = special_tokens.get(bos_token)
        self.eos_token_id = special_tokens.get(eos_token)
        ends = [self.eos_token_id] + [special_tokens.get(t) for t in _END_OF_TURN]
        self.stop_token_ids = list(dict.fromkeys(i for i in ends if i is not None))
        self.vocab_size = max([*ranks.values(), *special_tokens.values()]) + 1
        self._pattern = pattern
        # tiktoken needs every single byte to have a rank: give the vocab's missing ones unused ids.
        self._missing_bytes = {b for b in range(256) if bytes([b]) not in ranks}
        sentinels = {bytes([b]): self.vocab_size + i for i, b in enumerate(sorted(self._missing_bytes))}
        self._sentinel_ids = set(sentinels.values())
        self._enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks={**ranks, **sentinels},
                                      special_tokens=special_tokens)
        # Longest first, so a special token is never matched by a shorter one that prefixes it.
        names = sorted(special_tokens, key=len, reverse=True)
        self._special_split = re.compile("(" + "|".join(map(re.escape, names)) + ")" if names else "(?!)")

    def encode(self, text: str) -> list[int]:
        """Plain text to ids: no bos, and special-token text is just text."""
        ids = self._enc.encode_ordinary(text)
        return ids if self._sentinel_ids.isdisjoint(ids) else self._encode_dropping_missing_bytes(text)

    def _encode_dropping_missing_bytes(self, text: str) -> list[int]:
        """Like HF, drop bytes the vocab lacks *before* merging, so their neighbours can still merge."""
        # tiktoken cannot hand out its pieces, so split again with Python's regex (same pattern).
        pieces = (bytes(b for b in piece.encode() if b not in self._missing_bytes)
                  for piece in regex.findall(self._pattern, text))
        return [i for p in pieces if p for i in self._enc._encode_single_piece(p)]

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self._enc.decode_bytes([i for i in ids if i not in self._sentinel_ids])

    def token_bytes(self, token_id: int) -> bytes | None:
        """A regular token's bytes; None for a special token or an id the vocabulary does not have."""
        if token_id in self._special_ids or token_id in self._sentinel_ids:
            return None
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            return None

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads `tools` (HF's convention for function tools), so it can be given them."""
        return self.chat_template is not None and _reads_tools(self.chat_template)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The prompt text the chat template makes of a conversation (and of the tools it may call)."""
        if self.chat_template is None:
            raise TinyVLLMError("this tokenizer has no chat template; put a chat_template.jinja file "
                                "in the model directory or set chat_template in tokenizer_config.json")
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateSyntaxError as e:  # str(e) spans lines: the message and line number are enough
            raise TinyVLLMError(f"the chat template has a syntax error at line {e.lineno}: {e.message}; "
                                "fix chat_template.jinja or chat_template in tokenizer_config.json") from None
        except jinja2.TemplateError as e:  # e.g. the template's raise_exception() refusing this conversation
            raise TinyVLLMError(f"the chat template failed: {e.message}") from None
        except Exception as e:  # the template's own code: range() past the sandbox's MAX_RANGE, 1/0, "a" - 1, ...
            detail = " ".join(str(e).split())[:200]  # one line, however the exception words it
            raise TinyVLLMError(f"the chat template failed ({type(e).__name__}: {detail}); fix chat_template.jinja "
                                "or chat_template in tokenizer_config.json") from e  # --debug: where it failed

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Prompt ids for a conversation, where only the template can produce special tokens (the caller keeps
        them out of `tools` and of other message fields than content: those are pasted in as they are)."""
        marked = [{**m, "content": f"\u3000\ue000{i}\ue001\u3000"} if isinstance(m.get("content"), str) else m
                  for i, m in enumerate(messages)]
        # split() yields [template, left pad, index, right pad, template, ...]
        parts = _CONTENT_MARKER.split(self.render_chat(marked, add_generation_prompt, tools))
        ids: list[int] = []
        text = ""  # plain text is encoded in runs, as HF encodes the text between special tokens
        for k in range(0, len(parts), 4):
            for piece in self._special_split.split(parts[k]):
                if piece in self.special_tokens:
                    ids += self.encode(text) + [self._template_token(piece)]
                    text = ""
                else:
                    text += piece
            if k + 1 < len(parts):
                content = messages[int(parts[k + 2])]["content"]
                content = content if parts[k + 1] else content.lstrip()  # the template trimmed it
                text += content if parts[k + 3] else content.rstrip()
        return ids + self.encode(text)

    def _template_token(self, token: str) -> int:
        """The id of a special token the template wrote. Not checked on loading, as a special token may lie
        past the model's vocabulary while no prompt uses it: Llama 3.2's tokenizer.json lists the vision
        model's <|image|> at 128256, and tests pair Llama 3's tokenizer with small random models."""
        i = self.special_tokens[token]
        if self.model_vocab_size is not None and i >= self.model_vocab_size:
            raise TinyVLLMError(f"{self.source}: the chat template writes the special token {token!r}, whose id {i} "
                                f"is past the model's vocabulary (config.json vocab_size {self.model_vocab_size}); "
                                "re-download the tokenizer files")
        return i


class IncrementalDecoder:
    """Streams text from ids fed one at a time, holding back bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.decode_bytes([token_id]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _compile_env() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])


@lru_cache(maxsize=8)
def _reads_tools(source: str) -> bool:
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(_compile_env().parse(source))
    except jinja2.TemplateSyntaxError:
        return False  # render_chat reports the syntax error itself


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the same sandbox and with the same helpers as HF transformers."""
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = _compile_env()
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load from a model directory or a tokenizer.model / tokenizer.json / .gguf file."""
    path = Path(path)
    if not path.exists():
        raise TinyVLLMError(f"tokenizer path {path} does not exist; pass a model directory or a "
                            "tokenizer.model, tokenizer.json or .gguf file")
    file = _find_tokenizer_file(path) if path.is_dir() else path
    specials_file = file  # where the special tokens are defined, for error messages
    if file.suffix == ".gguf":
        from tinyvllm.formats.gguf_convert import tokenizer_files_from_gguf  # here: gguf_convert imports this module

        files = tokenizer_files_from_gguf(file)
        hf_json, config = files["tokenizer.json"], files["tokenizer_config.json"]
    else:
        json_file = file if file.suffix == ".json" else file.parent / "tokenizer.json"
        hf_json = _read_tokenizer_json(json_file) if optional_file(json_file) else None
        specials_file = json_file if hf_json else file
        config_file = file.parent / "tokenizer_config.json"
        config = _read_tokenizer_config(config_file) if optional_file(config_file) else {}
    if file.name == "tokenizer.model":
        ranks, pattern = _read_tiktoken_ranks(file), LLAMA3_PATTERN
        specials = _added_tokens(hf_json) if hf_json else _llama3_special_tokens(len(ranks))
    elif file.suffix in (".json", ".gguf"):
        ranks, specials, pattern = _from_hf_json(hf_json, file)
    else:
        raise TinyVLLMError(f"{file} is not a tokenizer file; pass tokenizer.model, tokenizer.json or a .gguf")
    is_llama3 = "<|start_header_id|>" in specials and "<|eot_id|>" in specials
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    if is_llama3 and not config:  # a bare tokenizer.model: Meta's defaults
        bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    # in a model directory, the model's vocabulary: the special tokens a chat prompt uses must lie inside it
    model_vocab = load_config(file.parent).vocab_size if optional_file(file.parent / "config.json") else None
    return Tokenizer(ranks, specials, pattern, bos_token=bos, eos_token=eos, name=file.stem,
                     chat_template=_find_chat_template(file.parent, config, is_llama3),
                     model_vocab_size=model_vocab, source=str(specials_file))


def _find_tokenizer_file(folder: Path) -> Path:
    for name in ("tokenizer.model", "tokenizer.json"):
        if optional_file(folder / name):
            return folder / name
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise TinyVLLMError(f"no tokenizer in {folder}: expected tokenizer.model, tokenizer.json or "
                        "exactly one .gguf file; copy the model's tokenizer files there")


def _read_tokenizer_json(file: Path) -> dict:
    """tokenizer.json, checked where tinyvllm reads it: a byte-level BPE model, its vocab, added_tokens
    and the pre_tokenizer's shape (which pre_tokenizers are supported is _split_pattern's question)."""
    hf_json = read_json_object(file)
    model = hf_json.get("model")
    if not isinstance(model, dict):
        raise TinyVLLMError(f"{file}: model must be an object (the BPE vocab and merges), got {model!r:.80}; "
                            "re-download it")
    if model.get("type") != "BPE" or hf_json.get("normalizer") or model.get("byte_fallback"):
        raise TinyVLLMError(f"{file} is not a byte-level BPE tokenizer (Llama 3 / GPT-2 style), "
                            "the only kind tinyvllm supports")
    _check_vocab(model.get("vocab"), file)
    _check_merges(model.get("merges", []), model["vocab"], file)
    added = hf_json.get("added_tokens", [])
    if not isinstance(added, list) or not all(
            isinstance(t, dict) and isinstance(t.get("content"), str) and _is_rank(t.get("id")) for t in added):
        raise TinyVLLMError(f"{file}: added_tokens must be a list of {{\"id\": integer, \"content\": string}} "
                            "objects, ids from 0 to 2**32 - 1; re-download it")
    pre = hf_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else None
    if not isinstance(steps, list) or not all(isinstance(step, dict) for step in steps):
        raise TinyVLLMError(f"{file}: pre_tokenizer must be an object, or a Sequence of them in "
                            f"pretokenizers, got {pre!r:.80}; re-download it")
    return hf_json


def _check_vocab(vocab: object, file: Path) -> None:
    """model.vocab maps each token to its own id: tiktoken takes the ids as ranks and aborts on a repeat."""
    if not isinstance(vocab, dict) or not vocab:
        raise TinyVLLMError(f"{file}: model.vocab must be a non-empty {{token: id}} object; re-download it")
    owner: dict[int, str] = {}
    for token, i in vocab.items():
        if not _is_rank(i):
            raise TinyVLLMError(f"{file}: model.vocab gives {token!r} the id {i!r}; ids are integers from 0 "
                                "to 2**32 - 1")
        if i in owner:
            raise TinyVLLMError(f"{file}: model.vocab gives the id {i} to both {owner[i]!r} and {token!r}")
        owner[i] = token


def _is_rank(value: object) -> bool:
    """A token id tiktoken can hold: its ranks are 32-bit, and a larger one raises OverflowError deep inside it."""
    return is_token_id(value) and value < 2**32


def _check_merges(merges: object, vocab: dict[str, int], file: Path) -> None:
    """model.merges as HF's tokenizers checks it on loading: pairs of vocab tokens whose join is a token too.
    tiktoken merges by id and never reads them, so without this check garbage merges would load silently."""
    if not isinstance(merges, list):
        raise TinyVLLMError(f"{file}: model.merges must be a list of merges, got {merges!r:.80}; re-download it")
    for k, merge in enumerate(merges):  # plain checks only: Llama 3 has 280,000 merges
        pair = merge.split(" ") if type(merge) is str else merge
        if not (type(pair) is list and len(pair) == 2 and type(pair[0]) is str and type(pair[1]) is str):
            raise TinyVLLMError(f"{file}: model.merges[{k}] is {merge!r:.60}; a merge is \"left right\" or "
                                "[\"left\", \"right\"]; re-download it")
        left, right = pair
        if left not in vocab or right not in vocab or left + right not in vocab:
            unknown = next(t for t in (left, right, left + right) if t not in vocab)
            raise TinyVLLMError(f"{file}: model.merges[{k}] {merge!r:.60} makes or uses {unknown!r:.40}, which "
                                "is not in model.vocab; re-download it")


def _read_tokenizer_config(file: Path) -> dict:
    """tokenizer_config.json, checked where tinyvllm reads it: bos_token, eos_token and chat_template."""
    config = read_json_object(file)
    for key in ("bos_token", "eos_token"):
        if config.get(key) is not None and not isinstance(_token_text(config[key]), str):
            raise TinyVLLMError(f"{file}: {key} must be a string or {{\"content\": string}}, got {config[key]!r}")
    template = config.get("chat_template")
    named = isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str)
                                               for t in template)
    if not (template is None or isinstance(template, str) or named):
        raise TinyVLLMError(f"{file}: chat_template must be a string or a list of "
                            f"{{\"name\", \"template\"}} objects, got {template!r:.80}")
    return config


def _read_tiktoken_ranks(file: Path) -> dict[bytes, int]:
    """Parse tiktoken's format: one 'base64-token rank' pair per line; a rank is a token id, so unique."""
    ranks: dict[bytes, int] = {}
    taken: set[int] = set()
    for number, line in enumerate(file.read_bytes().splitlines(), 1):
        if line:
            token, rank = _tiktoken_pair(line, file, number, first=not ranks)
            if rank in taken:  # tiktoken would abort the process (a Rust panic), not raise
                raise TinyVLLMError(f"{file} line {number}: rank {rank} is given to an earlier token too; "
                                    "re-download the file")
            ranks[token] = rank
            taken.add(rank)
    if not ranks:
        raise TinyVLLMError(f"{file} is empty; re-download it")
    return ranks


def _tiktoken_pair(line: bytes, file: Path, number: int, first: bool) -> tuple[bytes, int]:
    """One line of a tiktoken file: (token bytes, rank)."""
    parts = line.split()
    if len(parts) == 2 and parts[1].isdigit():  # isdigit: no sign, so no negative rank
        try:
            return base64.b64decode(parts[0], validate=True), int(parts[1])
        except ValueError:  # binascii.Error: not base64
            pass
    if first:  # the very first line fails: another format altogether
        raise TinyVLLMError(f"{file} is not a tiktoken BPE file (Llama 3 format); "
                            "SentencePiece tokenizer.model files (Llama 2) are not supported")
    raise TinyVLLMError(f"{file} line {number} is not a 'base64-token rank' pair: {line[:60]!r}; re-download it")


def _llama3_special_tokens(first_id: int) -> dict[str, int]:
    """Meta's 256 Llama 3 special tokens: the named ones, then reserved ones numbered from 2."""
    names = _LLAMA3_NAMED + [f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(_LLAMA3_NAMED) + 2)]
    return {name: first_id + i for i, name in enumerate(names)}


def _added_tokens(hf_json: dict) -> dict[str, int]:
    return {t["content"]: t["id"] for t in hf_json.get("added_tokens", [])}


def _from_hf_json(hf_json: dict, file: Path) -> tuple[dict[bytes, int], dict[str, int], str]:
    """Ranks, special tokens and split regex of an HF byte-level BPE tokenizer.json (checked on reading)."""
    model = hf_json["model"]
    specials = _added_tokens(hf_json)
    special_ids = set(specials.values())
    try:  # merges follow id order in these vocabs, so an id works as tiktoken's merge rank
        ranks = {bytes(_UNICODE_TO_BYTE[c] for c in tok): i for tok, i in model["vocab"].items() if i not in special_ids}
    except KeyError:
        raise TinyVLLMError(f"{file} vocab is not in GPT-2 byte-level form; tinyvllm supports byte-level BPE only") from None
    return ranks, specials, _split_pattern(hf_json.get("pre_tokenizer"), file)


def _split_pattern(pre: dict | None, file: Path) -> str:
    """The one regex equivalent to the pre_tokenizer shapes used by Llama 3, GPT-2 and SmolLM2."""
    steps = pre.get("pretokenizers", [pre]) if pre else []
    shape = [s.get("type") for s in steps]
    if shape[-1:] == ["ByteLevel"] and not steps[-1].get("add_prefix_space"):
        first, gpt2_regex = steps[0], steps[-1].get("use_regex", True)
        pattern = first.get("pattern") if isinstance(first.get("pattern"), dict) else {}
        isolated_regex = first.get("behavior") == "Isolated" and isinstance(pattern.get("Regex"), str)
        if shape == ["Split", "ByteLevel"] and not gpt2_regex and isolated_regex:
            return _checked_regex(pattern["Regex"], file)
        if shape == ["ByteLevel"] and gpt2_regex:
            return GPT2_PATTERN
        if shape == ["Digits", "ByteLevel"] and gpt2_regex and first.get("individual_digits"):
            return GPT2_DIGITS_PATTERN
    raise TinyVLLMError(f"{file} has a pre_tokenizer tinyvllm does not support ({shape}); "
                        "supported: Llama 3 Split regex, GPT-2 ByteLevel, Digits + ByteLevel")


def _checked_regex(pattern: str, file: Path) -> str:
    """The Split regex, compiled here so that a broken one is a one-line error, not tiktoken's ValueError."""
    try:
        regex.compile(pattern)
    except regex.error as e:
        raise TinyVLLMError(f"{file}: the pre_tokenizer's Split regex does not compile ({e}); re-download it") from None
    return pattern


def _token_text(token: str | dict | None) -> str | None:
    """tokenizer_config.json writes a token as its text or as {"content": text, ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _find_chat_template(folder: Path, config: dict, is_llama3: bool) -> str | None:
    jinja = folder / "chat_template.jinja"
    if optional_file(jinja):
        try:
            return jinja.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise TinyVLLMError(f"{jinja} is not UTF-8 text; re-download or re-create it") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is for chat
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template or (LLAMA3_CHAT_TEMPLATE if is_llama3 else None)
