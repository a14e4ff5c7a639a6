"""Tool calling on /v1/chat/completions, the request side: the `tools` and `tool_choice` a
client sends (checked), the conversation's earlier calls and results rendered through the
model's own chat template, the grammar that forces a call, and the calls in OpenAI's shape.

`tool_choice`: "none" (no call), "auto" (the model chooses; its text is read for calls in
its family's format, tool_parsers.py), "required" (at least one call) or a named function
(that one). The last two constrain the output with a JSON schema, as vLLM does: "required"
to an array of {"name", "parameters"} objects (one per offered function, by `anyOf`), a
named function to its own parameters' schema.

A chat template that knows nothing of tools (it never mentions `tools`, the default model's
among them) gets the tools in the system prompt, in `TOOLS_PROMPT`'s words, and earlier
calls and results as text in the Hermes format it asks for, so "auto" works there too."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from pydantic import field_validator

from sgl_nb.server.refusals import BadRequest
from sgl_nb.server.requests_common import Strict
from sgl_nb.server.tool_parsers import (
    ArgsPiece,
    CallStart,
    Event,
    NamedReader,
    PlainReader,
    Reader,
    RequiredReader,
    TextPiece,
    ToolCallFormat,
    auto_reader,
    format_of_template,
)

if TYPE_CHECKING:
    from sgl_nb.server.requests_openai import ChatCompletionRequest, Message

# ---- what the client sends ------------------------------------------------------------------


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _named(cls, name: str) -> str:
        if not name:
            raise ValueError("must be a non-empty string")
        return name


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON text, as the model wrote it
    parsed_arguments: Any = None  # the openai package's reading of them, sent back: unused


class ToolCall(Strict):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # a streamed call's, sent back: unused


# ---- the request's tool use, checked ---------------------------------------------------------

class ToolChoiceKind(Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


# An absent parameters schema means a function without arguments (OpenAI's reading).
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolUse:
    tools: list[Tool]
    choice: ToolChoiceKind
    name: str | None  # the function a named tool_choice asks for
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice in (ToolChoiceKind.REQUIRED, ToolChoiceKind.NAMED)

    def parameters(self, tool: Tool) -> dict:
        return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS

    def schema(self) -> dict | None:
        """The JSON schema the output is constrained to (None: the model writes freely)."""
        if self.choice is ToolChoiceKind.NAMED:
            return self.parameters(next(t for t in self.tools if t.function.name == self.name))
        if self.choice is not ToolChoiceKind.REQUIRED:
            return None
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _without_defs(self.parameters(t))},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools]}}
        if not self.parallel:
            schema["maxItems"] = 1
        schema.update(_shared_defs(self.tools))
        return schema

    def reader(self, template: str) -> Reader:
        """What reads this request's output into text and calls."""
        if self.choice is ToolChoiceKind.NAMED:
            return NamedReader(self.name)
        if self.choice is ToolChoiceKind.REQUIRED:
            return RequiredReader()
        if self.choice is ToolChoiceKind.AUTO:
            names = {t.function.name for t in self.tools}
            return auto_reader(format_of_template(template), names, self.parallel)
        return PlainReader()


def tool_use(body: ChatCompletionRequest, check_schema) -> ToolUse | None:
    """The request's tools and choice, checked (400s in vLLM's cases: an empty `tools`, a
    `tool_choice` without tools, one naming a function not offered, a parameters schema
    that does not compile). check_schema(schema) raises ValueError for a bad schema."""
    choice = body.tool_choice
    if body.tools is not None and not body.tools:
        raise BadRequest("tools must not be an empty array: give at least one tool or leave "
                         "the field out")
    if not body.tools:
        if choice in (None, "none"):
            return None
        raise BadRequest(f"tool_choice {_choice_text(choice)} is only allowed when tools are "
                         "given")
    names = [t.function.name for t in body.tools]
    for i, tool in enumerate(body.tools):
        if names.index(tool.function.name) != i:
            raise BadRequest(f"tools[{i}].function.name: {tool.function.name!r} is given twice")
        if tool.function.parameters is not None:
            try:
                check_schema(tool.function.parameters)
            except ValueError as e:
                raise BadRequest(f"tools[{i}].function.parameters (of {tool.function.name!r}) "
                                 f"is not a valid JSON schema: {_reason(e)}") from e
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise BadRequest(f"tool_choice names the function {choice.function.name!r}, which "
                             f"is not among the tools ({', '.join(map(repr, names))})")
        kind, name = ToolChoiceKind.NAMED, choice.function.name
    else:
        kind, name = ToolChoiceKind(choice or "auto"), None
    use = ToolUse(list(body.tools), kind, name, body.parallel_tool_calls is not False)
    if use.forced:
        _shared_defs(use.tools)  # conflicting definitions: a 400 now, not a bad grammar
    return use


def _reason(error: ValueError) -> str:
    """xgrammar's own words, without its source location ("[12:00:00] file.cc:12: ")."""
    text = str(error.__cause__ or error).strip().splitlines()[-1]
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)


def _choice_text(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


def _without_defs(schema: dict) -> dict:
    return {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}


def _shared_defs(tools: list[Tool]) -> dict:
    """The tools' `$defs` / `definitions`, moved to the array schema's root where their
    `#/$defs/...` references point once the parameters are nested in it."""
    out: dict[str, dict] = {}
    for tool in tools:
        for key in ("$defs", "definitions"):
            for name, schema in ((tool.function.parameters or {}).get(key) or {}).items():
                if out.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise BadRequest(f"tools: two functions define {key}/{name} differently; "
                                     "tool_choice 'required' needs one definition per name")
    return out


# ---- the prompt --------------------------------------------------------------------------------

TOOLS_PROMPT = """\
# Tools

You can call functions to answer. These are their signatures, one JSON object per line:
<tools>
{tools}
</tools>

To call functions, write one block per call, each holding a JSON object with the \
function's name and its arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments as a JSON object>}}}}
</tool_call>"""


@dataclass
class ChatTemplate:
    """What the model's chat template does with tools, read off its text."""

    text: str

    @property
    def takes_tools(self) -> bool:
        return "tools" in self.text

    @property
    def renders_calls(self) -> bool:
        return "tool_calls" in self.text

    @property
    def format(self) -> ToolCallFormat:
        return format_of_template(self.text)


def template_of(tokenizer) -> ChatTemplate:
    text = getattr(tokenizer, "chat_template", None)
    return ChatTemplate(text if isinstance(text, str) else json.dumps(text or ""))


def template_tools(use: ToolUse | None) -> list[dict] | None:
    """The tools as the chat template reads them (`tool | tojson` in most)."""
    if use is None:
        return None
    return [{"type": "function", "function": {
        **t.function.model_dump(exclude_none=True, exclude={"strict"}),
        "parameters": use.parameters(t)}} for t in use.tools]


def template_messages(messages: list[Message], template: ChatTemplate,
                      tools: list[dict] | None) -> list[dict]:
    """The conversation as the chat template reads it. A template that renders tools and
    calls gets them as transformers documents them (arguments as an object); one that does
    not gets them as text, in the format the tools prompt asks for."""
    native = template.takes_tools
    out: list[dict] = []
    results: dict | None = None  # the user turn that holds tool results (not native)
    for m in messages:
        if m.role == "tool" and not native:
            # One user turn for consecutive results: templates without tools know no
            # "tool" role, and some want user and assistant turns to alternate.
            text = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1] is results:
                results["content"] += "\n" + text
            else:
                results = {"role": "user", "content": text}
                out.append(results)
        else:
            out.append(_template_message(m, template, native))
    if tools and not native:
        block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _template_message(m: Message, template: ChatTemplate, native: bool) -> dict:
    entry: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.role == "tool":
        entry["tool_call_id"] = template_call_id(m.tool_call_id or "", template)
        if m.name:
            entry["name"] = m.name
    elif m.tool_calls and native and template.renders_calls:
        entry["tool_calls"] = [_call_for_template(c, template) for c in m.tool_calls]
    elif m.tool_calls:
        entry["content"] = "\n".join([entry["content"]] * bool(entry["content"])
                                     + [_hermes(c) for c in m.tool_calls])
    return entry


def _call_for_template(call: ToolCall, template: ChatTemplate) -> dict:
    return {"id": template_call_id(call.id, template), "type": "function",
            "function": {"name": call.function.name, "arguments": _arguments(call)}}


def _arguments(call: ToolCall) -> Any:
    """The arguments as an object, as templates expect them (`arguments | tojson`)."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def template_call_id(call_id: str, template: ChatTemplate) -> str:
    """Mistral's template refuses ids that are not 9 letters or digits: a call's id and
    its result's tool_call_id map to the same 9 characters there."""
    if template.format is ToolCallFormat.MISTRAL:
        return hashlib.sha1(call_id.encode()).hexdigest()[:9]
    return call_id


def _hermes(call: ToolCall) -> str:
    body = json.dumps({"name": call.function.name, "arguments": _arguments(call)})
    return f"<tool_call>\n{body}\n</tool_call>"


# ---- the answer --------------------------------------------------------------------------------

def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def reader_for(tools: ToolUse | None, template: ChatTemplate) -> Reader:
    """A new reader for one answer (it keeps the state of the text read so far)."""
    return PlainReader() if tools is None else tools.reader(template.text)


def read_all(reader: Reader, text: str) -> list[Event]:
    return [*reader.feed(text), *reader.finish()]


def message(events: list[Event]) -> dict:
    """The assistant message: its text as `content` (null when only calls were made), its
    calls as `tool_calls`."""
    text, calls = [], []
    for e in events:
        if isinstance(e, TextPiece):
            text.append(e.text)
        elif isinstance(e, CallStart):
            calls.append({"id": call_id(), "type": "function",
                          "function": {"name": e.name, "arguments": ""}})
        else:
            calls[e.index]["function"]["arguments"] += e.text
    content = "".join(text)
    out: dict[str, Any] = {"role": "assistant", "content": content if content or not calls
                           else None}
    if calls:
        out["tool_calls"] = calls
    return out


def delta(event: Event) -> dict:
    """One streamed piece, as OpenAI streams it: a call's id, type and name first, then its
    arguments in pieces, each under the call's index."""
    if isinstance(event, TextPiece):
        return {"content": event.text}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": call_id(), "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    assert isinstance(event, ArgsPiece)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def finish_reason(engine_reason: str, called: bool) -> str:
    """"tool_calls" when the answer made calls and ended by itself; "length" (cut short)
    and "abort" stay what they are."""
    return "tool_calls" if called and engine_reason == "stop" else engine_reason
