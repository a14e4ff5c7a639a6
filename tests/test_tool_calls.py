"""Tool calling on `sgl-nb serve`'s /v1/chat/completions, checked with the official `openai`
package (sync and async, streamed through its own accumulation helpers and not):
`tool_choice="required"` and a named function constrained by the tools' JSON schemas on the
real default model, a conversation carrying a call and its result, `auto` read in each
family's format (unit tests of the readers, and end to end with the output steered into
the format by a regex), and the 400s of bad tool requests."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_nb.server import tool_calls
from sgl_nb.server.tool_parsers import (
    HermesReader,
    LeadingJsonReader,
    NamedReader,
    RequiredReader,
    ToolCallFormat,
    format_of_template,
)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True,
                                           "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "strict": True,
                                           "description": "Add two integers",
                                           "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMES = {"get_weather", "add"}


# ---- reading each family's format (no model) ---------------------------------------------

def read(reader_of, text: str, step: int | None = None) -> dict:
    """The message a reader makes of text, fed whole or in pieces of `step` characters."""
    reader = reader_of()
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]
    events = [e for p in pieces for e in reader.feed(p)] + reader.finish()
    return strip_ids(tool_calls.message(events))


def strip_ids(message: dict) -> dict:
    for call in message.get("tool_calls", []):
        assert call.pop("id").startswith("call_")
    return message


def calls(*pairs) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for n, a in pairs]


def same_in_any_pieces(reader_of, text: str) -> dict:
    """A stream, cut anywhere, reads as the whole text does."""
    whole = read(reader_of, text)
    for step in (1, 2, 3, 7):
        assert read(reader_of, text, step) == whole, step
    return whole


HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": '
          '{"a": 1, "b": 2}}\n</tool_call>\n')


def test_hermes_calls_among_text():
    hermes = lambda: HermesReader(NAMES, parallel=True)  # noqa: E731
    assert same_in_any_pieces(hermes, HERMES) == {
        "role": "assistant", "content": "Let me look.",
        "tool_calls": calls(("get_weather", {"city": "Paris", "unit": "celsius"}),
                            ("add", {"a": 1, "b": 2}))}
    # parallel_tool_calls=false: the first call only
    one = read(lambda: HermesReader(NAMES, parallel=False), HERMES, 1)
    assert [c["function"]["name"] for c in one["tool_calls"]] == ["get_weather"]
    # Qwen2.5 writes "arguments"; some models "parameters", or the arguments as a string
    alt = '<tool_call>{"name": "add", "parameters": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
    assert read(hermes, alt)["tool_calls"] == calls(("add", {"a": 3, "b": 4}))


@pytest.mark.parametrize("text", [
    "No tools needed: 4.",
    "Half a tag <tool_ at the end",
    "Broken <tool_call>{not json}</tool_call> stays text  ",
    '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": 1',  # cut short
    "  leading and trailing whitespace kept  \n"])
def test_what_is_not_a_call_stays_text_exactly(text):
    assert same_in_any_pieces(lambda: HermesReader(NAMES, True), text) == {
        "role": "assistant", "content": text}


def test_an_unterminated_block_that_parses_is_a_call():
    text = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
    assert same_in_any_pieces(lambda: HermesReader(NAMES, True), text) == {
        "role": "assistant", "content": "Sure.", "tool_calls": calls(("add", {"a": 1, "b": 2}))}


@pytest.mark.parametrize("text", [
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}',
    '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}',
    '\n{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}; '
    '{"name": "add", "parameters": {"a": 1, "b": 2}}'])
def test_llama3_json_calls(text):
    out = same_in_any_pieces(lambda: LeadingJsonReader(NAMES, True, ToolCallFormat.LLAMA_JSON),
                             text)
    assert out["content"] is None
    assert out["tool_calls"][0] == calls(("get_weather", {"city": "Rome",
                                                          "unit": "celsius"}))[0]
    assert len(out["tool_calls"]) == 1 + text.count(";")


@pytest.mark.parametrize("text", [
    "The answer is 42.", '{"answer": 42}', '{"name": "add", "parameters": {"a": 1}} trailing',
    "<|python_tag|>print(1)"])
def test_llama3_json_that_is_not_a_call_stays_text(text):
    llama = lambda: LeadingJsonReader(NAMES, True, ToolCallFormat.LLAMA_JSON)  # noqa: E731
    assert same_in_any_pieces(llama, text) == {"role": "assistant", "content": text}


@pytest.mark.parametrize("text,content", [
    ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]', None),
    # the marker is a special token, decoded away
    (' [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]', None),
    ('Checking both. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
     '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]',
     "Checking both.")])
def test_mistral_calls(text, content):
    mistral = lambda: LeadingJsonReader(NAMES, True, ToolCallFormat.MISTRAL)  # noqa: E731
    assert same_in_any_pieces(mistral, text) == {
        "role": "assistant", "content": content,
        "tool_calls": calls(("add", {"a": 1, "b": 2}),
                            ("get_weather", {"city": "Oslo", "unit": "celsius"}))}
    for plain in ("[1, 2]", "[TOOL_CALLS] nonsense", "A list: [TOOL_"):
        assert same_in_any_pieces(mistral, plain) == {"role": "assistant", "content": plain}


def test_forced_outputs_stream_their_arguments_as_they_come():
    text = ('[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", '
            '"parameters": {"city": "Nice \\"}]\\" town", "unit": "celsius"}}]')
    out = same_in_any_pieces(RequiredReader, text)
    assert out == {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}},
        {"type": "function", "function": {"name": "get_weather", "arguments":
                                          '{"city": "Nice \\"}]\\" town", "unit": "celsius"}'}}]}
    reader = RequiredReader()
    pieces = [e for ch in text for e in reader.feed(ch)]
    assert len(pieces) > 20  # the arguments go out a character at a time, not at the end
    named = same_in_any_pieces(lambda: NamedReader("add"), '{"a": 5, "b": 6}')
    assert named["tool_calls"] == calls(("add", {"a": 5, "b": 6}))


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.one_of(
    st.text(max_size=12),
    st.sampled_from(["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "[",
                     '{"name": "add", "arguments": {"a": 1, "b": 2}}', "\n", " ", ";",
                     '{"name": "add", "parameters": {"a": 1}}', "<tool_", '"}]'])), max_size=8),
       step=st.integers(1, 5), fmt=st.sampled_from(list(ToolCallFormat)))
def test_any_text_reads_the_same_in_pieces_and_loses_nothing(parts, step, fmt):
    """Whatever the model writes: no exception, the stream says what the answer says, and
    an answer without calls is its text exactly."""
    from sgl_nb.server.tool_parsers import auto_reader

    text = "".join(parts)
    reader_of = lambda: auto_reader(fmt, NAMES, parallel=True)  # noqa: E731
    whole = read(reader_of, text)
    assert read(reader_of, text, step) == whole
    if "tool_calls" not in whole:
        assert whole["content"] == text
    for call in whole.get("tool_calls", []):
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_the_format_is_read_off_the_template():
    assert format_of_template(HERMES_TEMPLATE) is ToolCallFormat.HERMES
    assert format_of_template(LLAMA3_TEMPLATE) is ToolCallFormat.LLAMA_JSON
    assert format_of_template(MISTRAL_TEMPLATE) is ToolCallFormat.MISTRAL
    assert format_of_template("{{ messages }}") is ToolCallFormat.HERMES  # our own prompt


def request(**fields):
    from sgl_nb.server.requests_openai import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, **fields})


def test_the_required_schema_admits_calls_to_the_tools_only():
    use = tool_calls.tool_use(request(tool_choice="required"), check_schema=lambda s: None)
    schema = use.schema()
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}},
                         {"name": "get_weather",
                          "parameters": {"city": "Oslo", "unit": "celsius"}}], schema)
    for bad in ([], [{"name": "add", "parameters": {"a": "1", "b": 2}}],
                [{"name": "nope", "parameters": {}}], [{"name": "add"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = tool_calls.tool_use(request(tool_choice="required", parallel_tool_calls=False),
                              check_schema=lambda s: None).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}] * 2, one)
    named = tool_calls.tool_use(
        request(tool_choice={"type": "function", "function": {"name": "add"}}),
        check_schema=lambda s: None)
    assert named.schema() == ADD


def test_definitions_move_to_the_root_of_the_required_schema():
    """`#/$defs/...` references keep pointing at their definitions once nested."""
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}},
              "required": ["at"], "$defs": {"Point": point}}
    tools = [{"type": "function", "function": {"name": "go", "parameters": params}}]
    use = tool_calls.tool_use(request(tools=tools, tool_choice="required"), lambda s: None)
    schema = use.schema()
    jsonschema.validate([{"name": "go", "parameters": {"at": {"x": 1.5}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"at": {"x": "far"}}}], schema)
    other = {**tools[0]["function"], "name": "come",
             "parameters": {**params, "$defs": {"Point": {"type": "string"}}}}
    clash = request(tools=[*tools, {"type": "function", "function": other}],
                    tool_choice="required")
    with pytest.raises(ValueError, match=r"\$defs/Point differently"):
        tool_calls.tool_use(clash, lambda s: None)


@pytest.mark.slow  # the default model's folder (converted on first use)
def test_a_template_without_tools_gets_them_as_text(model_path):
    """The default model's template never mentions tools: they go in the system prompt (after
    the client's own), calls and results as text, consecutive results in one user turn."""
    from transformers import AutoTokenizer

    template = tool_calls.template_of(AutoTokenizer.from_pretrained(str(model_path)))
    assert not template.takes_tools
    body = request(messages=[
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "add", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "3"},
        {"role": "tool", "tool_call_id": "b", "content": "sunny"}])
    use = tool_calls.tool_use(body, lambda s: None)
    out = tool_calls.template_messages(body.messages, template, tool_calls.template_tools(use))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert '"name": "get_weather", "description": "The weather in a city now"' in out[0]["content"]
    assert out[2]["content"] == (
        'Checking.\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert out[3]["content"] == ("<tool_response>\n3\n</tool_response>\n"
                                 "<tool_response>\nsunny\n</tool_response>")


def test_streamed_deltas_reassemble_with_the_openai_helper():
    """The openai package's own accumulator makes of our deltas the message we answer."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    reader = HermesReader(NAMES, True)
    events = [e for ch in HERMES for e in reader.feed(ch)] + reader.finish()
    state = ChatCompletionStreamState()
    head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    for delta in [{"role": "assistant", "content": None}, *map(tool_calls.delta, events), {}]:
        state.handle_chunk(chunk({**head, "choices": [{
            "index": 0, "delta": delta, "finish_reason": None if delta else "tool_calls"}]}))
    got = state.get_final_completion().choices[0]
    want = read(lambda: HermesReader(NAMES, True), HERMES)
    assert got.finish_reason == "tool_calls" and got.message.content == want["content"]
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want["tool_calls"]]


def chunk(data: dict):
    from openai.types.chat import ChatCompletionChunk

    return ChatCompletionChunk.model_validate(data)


# ---- end to end on the real default model ------------------------------------------------

@pytest.fixture(scope="module")
def server(runtime):
    from sgl_nb.server.serve import start_in_thread

    srv = start_in_thread(runtime, served_model_names=["m"])  # the name these tests send
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def valid_calls(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, its arguments checked against its tool's schema."""
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


@pytest.mark.slow
def test_required_is_a_valid_call_streamed_or_not(client):
    out = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                         tool_choice="required", temperature=0, max_tokens=80)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    made = valid_calls(choice.message)
    assert made
    with client.chat.completions.stream(model="m", messages=ASK, tools=TOOLS,
                                        tool_choice="required", temperature=0,
                                        max_tokens=80) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert kinds.count("tool_calls.function.arguments.delta") > 2  # really streamed
    assert kinds.count("tool_calls.function.arguments.done") == len(made)
    assert final.choices[0].finish_reason == "tool_calls"
    assert valid_calls(final.choices[0].message) == made  # greedy: the same calls
    parsed = [c.function.parsed_arguments for c in final.choices[0].message.tool_calls]
    assert parsed == [args for _, args in made]


@pytest.mark.slow
def test_parallel_tool_calls_false_makes_one_call(client):
    ask = [{"role": "user", "content": "Add 2 and 3, then add 4 and 5, then get the "
                                       "weather in Oslo and in Rome."}]
    out = client.chat.completions.create(model="m", messages=ask, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         temperature=0, max_tokens=120)
    assert len(valid_calls(out.choices[0].message)) == 1


@pytest.mark.slow
def test_a_named_function_async_streamed_or_not(server):
    from openai import AsyncOpenAI

    named = {"type": "function", "function": {"name": "add"}}
    ask = [{"role": "user", "content": "What is 20 plus 22?"}]

    async def both():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300,
                             max_retries=0)
        out = await client.chat.completions.create(model="m", messages=ask, tools=TOOLS,
                                                   tool_choice=named, temperature=0,
                                                   max_tokens=40)
        async with client.chat.completions.stream(model="m", messages=ask, tools=TOOLS,
                                                  tool_choice=named, temperature=0,
                                                  max_tokens=40) as stream:
            deltas = [e async for e in stream if e.type == "tool_calls.function.arguments.delta"]
            final = await stream.get_final_completion()
        await client.close()
        return out, deltas, final

    out, deltas, final = asyncio.run(both())
    assert out.choices[0].finish_reason == "tool_calls"
    [(name, args)] = valid_calls(out.choices[0].message)
    assert name == "add"
    assert len(deltas) > 2 and valid_calls(final.choices[0].message) == [(name, args)]


@pytest.mark.slow
def test_a_conversation_with_a_call_and_its_result(client, runtime):
    """The call and its result reach the model as the tools prompt documents them (the
    default model's template knows no tools): the answer is the engine's own on that
    prompt. The assistant message goes back as the openai package returned it."""
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                           tool_choice="required", temperature=0,
                                           max_tokens=80)
    assistant = first.choices[0].message
    call = assistant.tool_calls[0]
    result = "18 degrees and sunny"
    history = [*ASK, assistant, {"role": "tool", "tool_call_id": call.id, "content": result}]
    out = client.chat.completions.create(model="m", messages=history, tools=TOOLS,
                                         tool_choice="none", temperature=0, max_tokens=12,
                                         extra_body={"ignore_eos": True})
    listed = "\n".join(json.dumps({"type": "function", "function": {
        k: v for k, v in t["function"].items() if k != "strict"}}) for t in TOOLS)
    system = tool_calls.TOOLS_PROMPT.format(tools=listed)
    called = json.dumps({"name": call.function.name,
                         "arguments": json.loads(call.function.arguments)})
    prompt = runtime.apply_chat_template([
        {"role": "system", "content": system}, *ASK,
        {"role": "assistant", "content": f"<tool_call>\n{called}\n</tool_call>"},
        {"role": "user", "content": f"<tool_response>\n{result}\n</tool_response>"}])
    want = runtime.generate(prompt, max_tokens=12, ignore_eos=True)
    assert out.usage.prompt_tokens == want.meta["prompt_tokens"]
    assert out.choices[0].message.content == want.text
    assert out.choices[0].message.tool_calls is None
    # A streamed answer's message, sent back as the helper assembled it, is taken too.
    with client.chat.completions.stream(model="m", messages=ASK, tools=TOOLS,
                                        tool_choice="required", temperature=0,
                                        max_tokens=80) as stream:
        streamed = stream.get_final_completion().choices[0].message
    again = client.chat.completions.create(
        model="m", messages=[*ASK, streamed, {"role": "tool", "content": result,
                                              "tool_call_id": streamed.tool_calls[0].id}],
        tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12,
        extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == want.text


HERMES_REGEX = (r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
                r'\{"city": "[A-Z][a-z]{2,8}", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


@pytest.mark.slow
def test_auto_reads_the_generic_format_on_the_default_model(client):
    """The output is steered into the format by a regex (the small model would not call on
    its own); what auto reads out of it is the model's own choice of city and unit."""
    kwargs = dict(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
                  extra_body={"structured_outputs": {"regex": HERMES_REGEX}})
    out = client.chat.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.content == "I will check."
    made = valid_calls(out.choices[0].message)
    assert [name for name, _ in made] == ["get_weather"]
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.content == "I will check." and valid_calls(final.message) == made
    # Without tools the same text is plain content.
    plain = client.chat.completions.create(**{**kwargs, "tools": None})
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content.startswith("I will check.\n<tool_call>")


# ---- bad tool requests -----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("change,needles", [
    ({"tool_choice": {"type": "function", "function": {"name": "lookup"}}},
     ["tool_choice names the function 'lookup'", "not among the tools", "'get_weather'"]),
    ({"tools": None, "tool_choice": "required"}, ["tool_choice 'required'",
                                                  "only allowed when tools are given"]),
    ({"tools": None, "tool_choice": {"type": "function", "function": {"name": "add"}}},
     ["only allowed when tools are given"]),
    ({"tools": []}, ["tools must not be an empty array"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strng"}}}}}]},
     ["tools[0].function.parameters", "'f'", "not a valid JSON schema", "strng"]),
    ({"tools": [TOOLS[0], TOOLS[0]]}, ["tools[1].function.name", "given twice"]),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, ["tools[0].function.name"]),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, ["tools[0]"]),
    ({"tool_choice": "sometimes"}, ["tool_choice"]),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     ["cannot be combined with response_format"]),
    ({"functions": [{"name": "f"}]}, ["functions (the legacy API; use tools)",
                                      "not supported"]),
    ({"messages": [*ASK, {"role": "tool", "content": "18"}]}, ["tool_call_id"]),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]},
     ["tool_calls belong to assistant messages"]),
])
def test_bad_tool_requests_are_named(server, change, needles):
    import httpx

    body = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 2, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    for needle in needles:
        assert needle in message, message


@pytest.mark.slow
def test_tool_choice_none_without_tools_is_accepted(client):
    out = client.chat.completions.create(model="m", messages=ASK, tool_choice="none",
                                         max_tokens=2)
    assert out.choices[0].message.content


# ---- templates that know tools: a tiny random-weight model per family ----------------------

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """\
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
Answer a call as {"name": function name, "parameters": dictionary of its arguments}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

<|python_tag|>{% for c in m.tool_calls %}{{ {"name": c.function.name, "parameters": \
c.function.arguments} | tojson }}{% if not loop.last %}; {% endif %}{% endfor %}<|eom_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL_TEMPLATE = """\
{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}[INST] {{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] [
{%- for c in m.tool_calls %}
{%- if c.id | length != 9 %}{{ raise_exception("Tool call ids must be 9 characters") }}\
{% endif %}
{{- {"name": c.function.name, "arguments": c.function.arguments, "id": c.id} | tojson }}
{%- if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- elif m.role == 'tool' %}[TOOL_RESULTS] {{ {"call_id": m.tool_call_id, "content": \
m.content} | tojson }}[/TOOL_RESULTS]
{%- else %} {{ m.content }}</s>
{%- endif %}{% endfor %}"""

FAMILIES = {
    "hermes": (HERMES_TEMPLATE, HERMES_REGEX.replace(r"I will check\.\n", ""), None),
    "llama3": (LLAMA3_TEMPLATE, r'\{"name": "get_weather", "parameters": \{"city": '
                                r'"[A-Z][a-z]{2,8}", "unit": "(celsius|fahrenheit)"\}\}', None),
    "mistral": (MISTRAL_TEMPLATE, r'One moment\. \[TOOL_CALLS\] \[\{"name": "get_weather", '
                                  r'"arguments": \{"city": "[A-Z][a-z]{2,8}", '
                                  r'"unit": "(celsius|fahrenheit)"\}\}\]', "One moment."),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, model_path):
    """A tiny random Llama with the default tokenizer and this family's chat template,
    served: its weights do not matter, the regex steers the output."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from sgl_nb import Runtime
    from sgl_nb.server.serve import start_in_thread

    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    template, regex, content = FAMILIES[request.param]
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    rt = Runtime(folder, kv_pool_tokens=4096)
    srv = start_in_thread(rt, served_model_names=["m"])
    yield request.param, rt, srv, regex, content
    srv.shutdown()
    rt.shutdown()


@pytest.mark.slow
def test_auto_reads_each_familys_format(family):
    from openai import OpenAI

    name, rt, srv, regex, content = family
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    # Room for the whole regex at a character a token (random weights pick short ones).
    kwargs = dict(model="m", messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0,
                  max_tokens=200, extra_body={"structured_outputs": {"regex": regex}})
    out = client.chat.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "tool_calls", out
    assert out.choices[0].message.content == content
    made = valid_calls(out.choices[0].message)
    assert [n for n, _ in made] == ["get_weather"]
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == content
    assert valid_calls(final.message) == made


@pytest.mark.slow
def test_history_goes_through_the_familys_own_template(family):
    """Calls (arguments as an object), results (with their call's id; 9 characters for
    Mistral's template) and the tools reach the template as transformers documents them:
    the prompt is the one transformers renders from those messages."""
    from openai import OpenAI

    name, rt, srv, _, _ = family
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    call_id = "call_0123456789abcdef01234567"
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": '
                                                          '"celsius"}'}}]},
               {"role": "tool", "tool_call_id": call_id, "content": "18 degrees"}]
    out = client.chat.completions.create(model="m", messages=history, tools=TOOLS,
                                         tool_choice="none", temperature=0, max_tokens=8,
                                         extra_body={"ignore_eos": True})
    seen_id = tool_calls.template_call_id(call_id, tool_calls.template_of(rt.tokenizer))
    assert len(seen_id) == (9 if name == "mistral" else len(call_id))
    listed = [{"type": "function", "function": {k: v for k, v in t["function"].items()
                                                if k != "strict"}} for t in TOOLS]
    prompt = rt.tokenizer.apply_chat_template([
        *ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"id": seen_id, "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": seen_id, "content": "18 degrees"}],
        tools=listed, tokenize=False, add_generation_prompt=True)
    assert '"arguments": "{' not in prompt and '"parameters": "{' not in prompt
    want = rt.generate(prompt, max_tokens=8, ignore_eos=True)
    assert out.usage.prompt_tokens == want.meta["prompt_tokens"]
    assert out.choices[0].message.content == want.text
