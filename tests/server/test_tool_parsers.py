"""Tool-call parsers of each template family: whole answers, and the same answers
streamed in two pieces split at every character (and one character at a time)."""

import json

import pytest

from server.protocol.chat import ChatCompletionRequest
from server.text_pipeline.tool_formats import ParsedCall, detect_format, tool_format
from server.text_pipeline.tool_stream import stream_parser

WEATHER = ParsedCall("get_weather", '{"city": "Paris", "unit": "C"}')
TIME = ParsedCall("get_time", '{"zone": "UTC"}')

CASES = [
    # family, answer, expected content, expected calls
    ("generic", '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}},'
                '{"name":"get_time","arguments":{"zone":"UTC"}}]}', None, [WEATHER, TIME]),
    ("generic", '{"content":"It is \\"sunny\\" \\u00e9t\\u00e9 \\\\ today."}',
     'It is "sunny" été \\ today.', []),
    ("generic", "not an envelope", "not an envelope", []),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": '
               '"get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
     "Let me check.", [WEATHER, TIME]),
    ("hermes", "No tools needed: a < b and <tool is fine.",
     "No tools needed: a < b and <tool is fine.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
     None, [WEATHER]),
    ("llama3_json", "The weather is {unknown}.", "The weather is {unknown}.", []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
     "Sure.", [TIME]),
]


def normalised(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(family, pieces):
    parser = stream_parser(tool_format(family))
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content = "".join(value for kind, value in events if kind == "content")
    return content, [value for kind, value in events if kind == "call"]


@pytest.mark.parametrize("family, answer, content, calls", CASES)
def test_whole_answers(family, answer, content, calls):
    parsed = tool_format(family).parse(answer)
    assert parsed.content == content
    assert normalised(parsed.calls) == normalised(calls)


@pytest.mark.parametrize("family, answer, content, calls", CASES)
def test_streamed_answers_split_anywhere(family, answer, content, calls):
    for cut in range(len(answer) + 1):
        got_content, got_calls = streamed(family, [answer[:cut], answer[cut:]])
        assert got_content.strip() == (content or ""), (cut, got_content)
        assert normalised(got_calls) == normalised(calls), cut
    got_content, got_calls = streamed(family, list(answer))
    assert got_content.strip() == (content or "") and normalised(got_calls) == normalised(calls)


def test_content_streams_before_the_answer_ends():
    parser = stream_parser(tool_format("generic"))
    assert parser.feed('{"content":"Hel') == [("content", "Hel")]
    assert parser.feed('lo') == [("content", "lo")]
    parser = stream_parser(tool_format("hermes"))
    assert parser.feed("Checking <tool") == [("content", "Checking ")]


@pytest.mark.parametrize("template, family", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "generic"),
    ("{{ '<tool_call>' }}", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
])
def test_family_from_template(template, family):
    assert detect_format(template) == family


def request(**fields):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields})


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("family", ["generic", "hermes", "llama3_json", "mistral"])
def test_required_and_named_choices_get_a_grammar(family):
    body = request(tools=TOOLS, tool_choice="required")
    fmt = tool_format(family)
    assert fmt.grammar(body.tools, body.tool_choice, True) is not None
    named = request(tools=TOOLS, tool_choice={"type": "function",
                                              "function": {"name": "get_time"}})
    spec = fmt.grammar(named.tools, named.tool_choice, True)
    assert "get_time" in str(spec.value) and "get_weather" not in str(spec.value)
    assert (fmt.grammar(body.tools, "auto", True) is not None) == (family != "mistral")


SAMPLES = {  # family -> (a valid call answer, a text answer, a call to a function not offered)
    "generic": ('{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}}]}',
                '{"content":"Hello there."}',
                '{"tool_calls":[{"name":"get_mail"'),
    "hermes": ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>',
               "Hello there.", 'Sure.<tool_call>\n{"name":"get_mail"'),
    "llama3_json": ('{"name":"get_weather","parameters":{"city":"Oslo"}}', "Hello there.",
                    '{"name":"get_mail"'),
    "mistral": ('[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Oslo"}}]',
                "Hello there.", 'Sure.[TOOL_CALLS][{"name":"get_mail"'),
}


@pytest.mark.parametrize("family", ["generic", "hermes", "llama3_json", "mistral"])
def test_grammars_accept_calls_and_text_and_refuse_unknown_functions(family, tokenizer):
    from engine.structured.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    body = request(tools=TOOLS)
    call, text, bad = SAMPLES[family]

    def run(choice, answer):
        matcher = compiler.compile(tool_format(family).grammar(body.tools, choice, True)
                                   ).new_matcher((tokenizer.eos_token_id,))
        for token in tokenizer.encode(answer, add_special_tokens=False):
            matcher.accept(token)
        return matcher

    for choice in ("auto", "required") if family != "mistral" else ("required",):
        matcher = run(choice, call)
        assert matcher.error is None and matcher.eos_allowed(), (choice, call)
        assert run(choice, bad).error is not None
    if family != "mistral":
        assert run("auto", text).eos_allowed()
    assert run("required", text).error is not None
