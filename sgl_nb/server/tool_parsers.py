"""Reading tool calls out of generated text, piece by piece as it streams.

A reader is fed the text chunks of one answer and says what they are: plain text, the
start of a call (its name), or a piece of a call's arguments (a JSON text). The same reader
turns a whole answer into a message and a stream into deltas, so both say the same thing.

`tool_choice="auto"`: the model writes calls in its family's format, the one its chat
template teaches (read off the template's text, `format_of_template`):
- Hermes, Qwen2.5, Qwen3, SmolLM3 and the generic prompt for templates without tools:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text;
- Llama 3.x: `{"name": ..., "parameters": {...}}` (several joined by `;`), optionally after
  `<|python_tag|>`, as the whole answer;
- Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, ending the answer.
A call is only what parses as one, names an offered function and has an object for its
arguments; anything else stays text. Text that may be the start of a call is held back
until that is decided, so a stream never shows text that turns out to be a call.

`tool_choice="required"` or a named function: the grammar (tool_calls.py) makes the output
a JSON array of {"name", "parameters"} or the function's arguments: valid by construction,
so their arguments are passed on as they are generated.

Special tokens are decoded away (`<|python_tag|>`, `[TOOL_CALLS]` are special in their
tokenizers), so the markers are optional: an answer that opens with the format's JSON is
read as calls too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum


class ToolCallFormat(Enum):
    HERMES = "hermes"
    LLAMA_JSON = "llama3_json"
    MISTRAL = "mistral"


def format_of_template(template: str) -> ToolCallFormat:
    """What the chat template writes for a call; Hermes when it says nothing we know (our
    own prompt for templates without tools asks for that format)."""
    if "<tool_call>" in template:
        return ToolCallFormat.HERMES
    if "[TOOL_CALLS]" in template:
        return ToolCallFormat.MISTRAL
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return ToolCallFormat.LLAMA_JSON
    return ToolCallFormat.HERMES


@dataclass
class TextPiece:
    text: str


@dataclass
class CallStart:
    index: int
    name: str


@dataclass
class ArgsPiece:
    index: int
    text: str


Event = TextPiece | CallStart | ArgsPiece


class _Reader:
    """Emits text and whole calls. Whitespace next to a call is dropped (a model puts
    newlines around its calls), so `content` is the text the model wrote besides them."""

    def __init__(self, names: set[str], parallel: bool):
        self.names, self.parallel = names, parallel
        self.calls = 0
        self._ws = ""  # trailing whitespace, held until text follows it
        self._after_call = False

    def feed(self, piece: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _text(self, out: list[Event], text: str) -> None:
        if self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        if body:
            out.append(TextPiece(self._ws + body))
            self._ws, self._after_call = "", False
        self._ws += text[len(body):]

    def _call(self, out: list[Event], name: str, arguments: dict) -> None:
        self._ws, self._after_call = "", True
        if self.calls and not self.parallel:
            return  # parallel_tool_calls=false: the first call only
        out += [CallStart(self.calls, name),
                ArgsPiece(self.calls, json.dumps(arguments, ensure_ascii=False))]
        self.calls += 1

    def _end(self, out: list[Event]) -> list[Event]:
        if not self.calls and self._ws:
            out.append(TextPiece(self._ws))
        self._ws = ""
        return out

    def _as_call(self, obj, args_keys: tuple[str, ...]) -> tuple[str, dict] | None:
        """(name, arguments) if obj is a call to an offered function."""
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = next((obj[k] for k in args_keys if k in obj), {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        return (obj["name"], args) if isinstance(args, dict) else None


def _overlap(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper start of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesReader(_Reader):
    """`<tool_call>{json}</tool_call>` blocks among the text."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: set[str], parallel: bool):
        super().__init__(names, parallel)
        self._buf, self._in_block = "", False

    def feed(self, piece: str) -> list[Event]:
        self._buf += piece
        out: list[Event] = []
        while True:
            if not self._in_block:
                at = self._buf.find(self.OPEN)
                if at < 0:
                    keep = _overlap(self._buf, self.OPEN)
                    self._text(out, self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._text(out, self._buf[:at])
                self._buf, self._in_block = self._buf[at:], True
            end = self._buf.find(self.CLOSE)
            if end < 0:
                return out
            end += len(self.CLOSE)
            self._block(out, self._buf[:end])
            self._buf, self._in_block = self._buf[end:], False

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._in_block:  # cut short by a stop or max_tokens: a call if it parses
            self._block(out, self._buf)
        else:
            self._text(out, self._buf)
        self._buf = ""
        return self._end(out)

    def _block(self, out: list[Event], block: str) -> None:
        body = block[len(self.OPEN):].removesuffix(self.CLOSE)
        try:
            call = self._as_call(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            self._text(out, block)
        else:
            self._call(out, *call)


class LeadingJsonReader(_Reader):
    """Calls as JSON that ends the answer, after a marker (Mistral's `[TOOL_CALLS]`,
    Llama's `<|python_tag|>`) or, the marker being a special token decoded away, as the
    whole answer when it opens with the JSON. Held back until the answer ends."""

    def __init__(self, names: set[str], parallel: bool, fmt: ToolCallFormat):
        super().__init__(names, parallel)
        self.fmt = fmt
        if fmt is ToolCallFormat.MISTRAL:
            self.marker, self.opener = "[TOOL_CALLS]", "["
        else:
            self.marker, self.opener = "<|python_tag|>", "{"
        self._buf = ""  # from the marker on, once one is seen
        self._in_calls = False
        self._started = False  # some text was let go: the answer does not open with JSON

    def feed(self, piece: str) -> list[Event]:
        self._buf += piece
        out: list[Event] = []
        if self._in_calls:
            return out
        if not self._started:
            head = self._buf.lstrip()
            if not head or self.marker.startswith(head):
                return out
            if head.startswith((self.marker, self.opener)):
                self._in_calls = True
                return out
            self._started = True
        at = self._buf.find(self.marker)
        if at >= 0:
            self._text(out, self._buf[:at])
            self._buf, self._in_calls = self._buf[at:], True
            return out
        keep = _overlap(self._buf, self.marker)
        self._text(out, self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        calls = self._parse(self._buf) if self._in_calls else None
        if calls is None:
            self._text(out, self._buf)
        for call in calls or []:
            self._call(out, *call)
        self._buf = ""
        return self._end(out)

    def _parse(self, section: str) -> list[tuple[str, dict]] | None:
        text = section.strip().removeprefix(self.marker).strip()
        try:
            if self.fmt is ToolCallFormat.MISTRAL:
                objs = json.loads(text)
                if not isinstance(objs, list):
                    return None
            else:
                objs = _json_sequence(text)
        except ValueError:
            return None
        calls = [self._as_call(o, ("parameters", "arguments")) for o in objs]
        return calls if calls and None not in calls else None


def _json_sequence(text: str) -> list:
    """JSON values one after another, separated by `;` or whitespace (Llama 3.2's several
    calls)."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        value, i = decoder.raw_decode(text, i)
        out.append(value)
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
    return out


def auto_reader(fmt: ToolCallFormat, names: set[str], parallel: bool) -> Reader:
    if fmt is ToolCallFormat.HERMES:
        return HermesReader(names, parallel)
    return LeadingJsonReader(names, parallel, fmt)


class PlainReader:
    """No tools (or tool_choice "none"): all of it is text."""

    calls = 0

    def feed(self, piece: str) -> list[Event]:
        return [TextPiece(piece)]

    def finish(self) -> list[Event]:
        return []


# ---- forced calls: the output the grammar allows ------------------------------------------

class NamedReader:
    """tool_choice names the function: the whole output is its arguments."""

    def __init__(self, name: str):
        self.name, self.calls = name, 0

    def feed(self, piece: str) -> list[Event]:
        out: list[Event] = [] if self.calls else [CallStart(0, self.name)]
        self.calls = 1
        return out + [ArgsPiece(0, piece)] if piece else out

    def finish(self) -> list[Event]:
        return self.feed("")


class _ValueEnd:
    """Finds where a JSON value ends, reading each character once as the text grows."""

    def __init__(self, start: int):
        self.at, self.depth, self.in_string, self.escaped = start, 0, False, False

    def scan(self, text: str) -> int | None:
        """The index just past the value, or None if the text ends first."""
        while self.at < len(text):
            c = text[self.at]
            self.at += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return self.at
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return self.at
            elif self.depth == 0 and (c in ",}]" or c.isspace()):  # a number's end
                self.at -= 1
                return self.at
        return None


class RequiredReader:
    """tool_choice="required": `[{"name": ..., "parameters": {...}}, ...]`, keys in this
    order (the grammar's); the parameters text is passed on as it comes."""

    _HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,'
                       r'\s*"parameters"\s*:\s*(?=\S)')  # once the value's first character came

    def __init__(self):
        self.calls = 0  # started so far
        self._buf, self._pos = "", 0  # _pos: where the next call's head is looked for
        self._value: _ValueEnd | None = None  # the current call's arguments ...
        self._end: int | None = None  # ... and where they end, once known
        self._sent = 0  # how much of the current arguments went out

    def feed(self, piece: str) -> list[Event]:
        self._buf += piece
        out: list[Event] = []
        while True:
            if self._value is None:
                head = self._HEAD.match(self._buf, self._pos)
                if head is None:
                    return out
                out.append(CallStart(self.calls, json.loads(head.group(1))))
                self.calls += 1
                self._value, self._sent = _ValueEnd(head.end()), head.end()
            if self._end is None:
                self._end = self._value.scan(self._buf)
                upto = len(self._buf) if self._end is None else self._end
                if upto > self._sent:
                    out.append(ArgsPiece(self.calls - 1, self._buf[self._sent:upto]))
                    self._sent = upto
                if self._end is None:
                    return out
            close = self._buf.find("}", self._end)
            if close < 0:
                return out
            self._pos, self._value, self._end = close + 1, None, None

    def finish(self) -> list[Event]:
        return []


Reader = _Reader | PlainReader | NamedReader | RequiredReader
