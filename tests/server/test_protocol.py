"""Request schemas and body parsing: each bad input is a 400 naming its field."""

import pytest

from server.edge.body import parse_json_object, validate_model
from server.edge.errors import OpenAIError
from server.protocol.chat import ChatCompletionRequest
from server.protocol.completions import CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return validate_model(ChatCompletionRequest, {"messages": MSG, **fields})


def error_of(fn, *args, **kwargs) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(*args, **kwargs)
    return info.value


def test_nulls_mean_defaults():
    request = chat(max_tokens=None, temperature=None, stop=None, n=None, seed=None,
                   stream=None, logprobs=None)
    assert request.max_tokens is None and request.stop_strings == []


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": "x" * 513}, "stop"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"tool_choice": "required"}, None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, None),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0]"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
])
def test_bad_chat_fields_name_the_param(fields, param):
    error = error_of(chat, **fields)
    assert error.status_code == 400
    assert error.param == param, error.message


def test_unsupported_parameter_message():
    error = error_of(chat, functions=[{"name": "f"}])
    assert "functions" in error.message and error.code == "unsupported_parameter"


def test_fields_that_change_nothing_are_dropped_and_output_changers_kept():
    from server.edge.lenient_fields import drop_unknown_fields
    from server.protocol.chat import ChatMessage

    data = {"messages": [{"role": "developer", "content": "be brief", "id": "m1"}, *MSG],
            "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
            "audio": {"voice": "x"}, "modalities": ["text", "audio"]}
    kept = drop_unknown_fields(ChatCompletionRequest, data, ChatMessage)
    assert set(kept) == {"messages", "audio", "modalities"}
    assert kept["messages"][0] == {"role": "developer", "content": "be brief"}
    assert error_of(validate_model, ChatCompletionRequest, kept).param == "audio"
    plain = drop_unknown_fields(ChatCompletionRequest, {**data, "audio": None,
                                                        "modalities": ["text"]}, ChatMessage)
    request = validate_model(ChatCompletionRequest, {k: v for k, v in plain.items()
                                                     if k != "audio"})
    assert request.messages[0].to_template_dict() == {"role": "system", "content": "be brief"}


def test_tool_history_renders_for_templates():
    request = chat(messages=MSG + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"}])
    assistant, tool = (m.to_template_dict() for m in request.messages[1:])
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert tool == {"role": "tool", "content": "2", "tool_call_id": "c1"}


def test_text_parts_are_joined():
    request = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]}])
    assert request.messages[0].content == "ab"


def test_replayed_assistant_message_with_empty_sdk_fields_is_accepted():
    request = chat(messages=MSG + [{"role": "assistant", "content": None, "refusal": None,
                                    "tool_calls": None, "function_call": None}])
    assert request.messages[1].to_template_dict() == {"role": "assistant", "content": ""}


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_shapes(prompt, expected):
    assert validate_model(CompletionRequest, {"prompt": prompt}).prompts == expected


@pytest.mark.parametrize("prompt", [None, [], [[]], [1, "a"], [[1], "a"], 5, [True]])
def test_bad_prompts(prompt):
    assert error_of(validate_model, CompletionRequest, {"prompt": prompt}).param == "prompt"


def test_missing_prompt():
    error = error_of(validate_model, CompletionRequest, {})
    assert error.param == "prompt" and error.code == "missing_required_parameter"


def test_stream_options_need_stream():
    assert error_of(chat, stream_options={"include_usage": True}).status_code == 400
    assert chat(stream=True, stream_options={"include_usage": True}).stream_options.include_usage


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b'"text"', b'{"x": NaN}',
                                 b'{"x": Infinity}', b'{"x": 1e999}', b"\xff\xfe",
                                 b"[" * 100_000 + b"]" * 100_000])
def test_bad_json_bodies(raw):
    error = error_of(parse_json_object, raw)
    assert error.status_code == 400 and error.code == "invalid_json"


def test_lone_surrogates_become_replacement_chars():
    body = parse_json_object(b'{"messages": [{"role": "user", "content": "a\\ud800b\\u0000"}]}')
    assert body["messages"][0]["content"] == "a\ufffdb\x00"
