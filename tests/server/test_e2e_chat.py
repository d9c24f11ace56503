"""End to end: /v1/chat/completions on the real server, through the openai SDK."""

import pytest

MODEL = "smollm2-135m-instruct"  # the model the `server` fixture serves

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
HAIKU = [{"role": "user", "content": "Write a haiku about the sea."}]


def chat(client, messages=QUESTION, **kwargs):
    kwargs.setdefault("max_tokens", 16)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def stream_text(client, messages, **kwargs):
    chunks = list(chat(client, messages, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_chat_answers_with_openai_shape(client, server):
    response = chat(client, temperature=0)
    choice = response.choices[0]
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.model == MODEL
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    # Usage is exact: the prompt is the rendered template, the completion includes EOS.
    import httpx
    rendered = httpx.post(f"{server.base_url}/tokenize", headers=server.headers(),
                          json={"messages": QUESTION}).json()
    assert response.usage.prompt_tokens == rendered["count"]
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_streamed_text_equals_non_streamed_text(client):
    whole = chat(client, HAIKU, temperature=0).choices[0].message.content
    streamed, chunks = stream_text(client, HAIKU, temperature=0)
    assert streamed == whole and whole
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_include_usage_gives_a_final_usage_chunk(client):
    whole = chat(client, HAIKU, temperature=0, max_tokens=8)
    _, chunks = stream_text(client, HAIKU, temperature=0, max_tokens=8,
                            stream_options={"include_usage": True})
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_choices_and_unique_ids(client):
    first = chat(client, HAIKU, n=2, temperature=1.0, seed=7, max_tokens=8)
    second = chat(client, HAIKU, n=2, temperature=1.0, seed=7, max_tokens=8)
    assert [c.index for c in first.choices] == [0, 1]
    assert first.usage.completion_tokens == 16
    assert first.id != second.id
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    text, chunks = stream_text(client, HAIKU, n=2, temperature=0, max_tokens=4)
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_seed_reproducibility(client):
    texts = [chat(client, HAIKU, temperature=1.0, seed=s, max_tokens=12).choices[0].message.content
             for s in (11, 11, 12, 13)]
    assert texts[0] == texts[1]
    assert len(set(texts[1:])) > 1  # other seeds sample something else


def test_stop_string_across_token_boundary(client):
    whole = chat(client, HAIKU, temperature=0).choices[0].message.content
    space = whole.index(" ", 5)  # a stop spanning "<end of a word> <start of next>"
    stop = whole[space - 2:space + 2]
    expected = whole[:whole.index(stop)]
    response = chat(client, HAIKU, temperature=0, stop=[stop, "never-appears"])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 16
    streamed, chunks = stream_text(client, HAIKU, temperature=0, stop=stop)
    assert streamed == expected and chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_and_top_logprobs(client):
    response = chat(client, HAIKU, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(bytes(t.bytes).decode("utf-8", "replace") for t in content) == \
        response.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 3
        alternatives = [t.logprob for t in token.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        assert token.top_logprobs[0].token == token.token  # greedy picks the most likely
    streamed = list(chat(client, HAIKU, temperature=0, max_tokens=6, logprobs=True, stream=True))
    streamed_tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs
                       for t in c.choices[0].logprobs.content]
    assert streamed_tokens == [t.token for t in content]


def test_multibyte_characters_stream_whole(client):
    messages = [{"role": "user", "content": "Repeat: こんにちは"}]
    whole = chat(client, messages, temperature=0, logprobs=True)
    text = whole.choices[0].message.content
    assert "こんにちは" in text
    token_bytes = [bytes(t.bytes) for t in whole.choices[0].logprobs.content]
    assert any(_invalid_utf8(b) for b in token_bytes), "a character must span tokens here"
    streamed, chunks = stream_text(client, messages, temperature=0)
    assert streamed == text
    assert not any("\ufffd" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def _invalid_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_ignore_eos_and_stop_token_ids(client, server):
    response = chat(client, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 12 and response.choices[0].finish_reason == "length"
    greedy = chat(client, temperature=0).choices[0].message.content
    import httpx
    ids = httpx.post(f"{server.base_url}/tokenize", headers=server.headers(),
                     json={"prompt": greedy, "add_special_tokens": False}).json()["tokens"]
    stopped = chat(client, temperature=0, extra_body={"stop_token_ids": [ids[2]]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 3
    assert greedy.startswith(stopped.choices[0].message.content)


def test_sampling_parameters_are_accepted_and_change_output(client):
    base = chat(client, HAIKU, temperature=0, max_tokens=8).choices[0].message.content
    biased = chat(client, HAIKU, temperature=0, max_tokens=8,
                  logit_bias={"28": 100}).choices[0].message.content  # 28 = ","
    assert biased != base and set(biased) == {","}
    penalised = chat(client, HAIKU, temperature=0.7, top_p=0.9, seed=1, max_tokens=8,
                     presence_penalty=1.5, frequency_penalty=1.0, user="u1",
                     extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3})
    assert penalised.choices[0].message.content


def test_system_and_multi_turn_and_content_parts(client):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": [{"type": "text", "text": "Capital of "},
                                             {"type": "text", "text": "Italy?"}]},
                {"role": "assistant", "content": "Rome."},
                {"role": "user", "content": "And of France?"}]
    response = chat(client, messages, temperature=0, max_completion_tokens=8)
    assert response.choices[0].message.content
    assert response.usage.completion_tokens <= 8
