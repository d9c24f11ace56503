"""End to end: /v1/completions, /tokenize, /detokenize, /v1/models, /health."""

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"  # the model the `server` fixture serves
PROMPT = "The three primary colors are"


def complete(client, prompt=PROMPT, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def test_completion_shape_and_default_length(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.model == MODEL
    assert response.usage.completion_tokens == 16  # OpenAI's default max_tokens here
    assert response.choices[0].finish_reason == "length" and response.choices[0].text


def test_streamed_text_equals_non_streamed_text(client):
    whole = complete(client, temperature=0)
    chunks = list(complete(client, temperature=0, stream=True,
                           stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_prompt_shapes_and_choice_order(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = complete(client, temperature=0).choices[0].text
    by_ids = complete(client, prompt=ids, temperature=0).choices[0].text
    assert by_ids == by_text
    many = complete(client, prompt=[PROMPT, "One, two,"], n=2, temperature=0, max_tokens=4)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text != many.choices[2].text
    token_lists = complete(client, prompt=[ids, tokenizer.encode("One, two,")], temperature=0,
                           max_tokens=4)
    assert [c.text for c in token_lists.choices] == [many.choices[0].text, many.choices[2].text]
    assert token_lists.usage.prompt_tokens == len(ids) + len(tokenizer.encode("One, two,"))


def test_echo(client):
    response = complete(client, echo=True, temperature=0, max_tokens=4)
    plain = complete(client, temperature=0, max_tokens=4)
    assert response.choices[0].text == PROMPT + plain.choices[0].text
    chunks = list(complete(client, echo=True, temperature=0, max_tokens=4, stream=True))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == response.choices[0].text


def test_logprobs(client):
    response = complete(client, temperature=0, max_tokens=5, logprobs=2,
                        extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0 and token in top and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the best one
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_stop_strings_in_completions(client):
    whole = complete(client, temperature=0).choices[0].text
    stop = whole.strip().split()[1][:3]
    cut = complete(client, temperature=0, stop=stop)
    assert cut.choices[0].text == whole[:whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_models_health_tokenize_detokenize(client, server, tokenizer):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{server.base_url}/health").json()  # no key needed
    assert health["status"] == "ok" and "num_running" in health
    tokens = httpx.post(f"{server.base_url}/tokenize", headers=server.headers(),
                        json={"prompt": "héllo 🙂"}).json()
    assert tokens["tokens"] == tokenizer.encode("héllo 🙂") and tokens["count"] == len(tokens["tokens"])
    text = httpx.post(f"{server.base_url}/detokenize", headers=server.headers(),
                      json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "héllo 🙂"}
    rendered = httpx.post(f"{server.base_url}/tokenize", headers=server.headers(),
                          json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tokenizer.decode(rendered["tokens"]).endswith("<|im_start|>assistant\n")


def test_cors_for_browser_chat_uis(server):
    origin = "http://localhost:3000"  # the origin the `server` fixture allows
    preflight = httpx.options(f"{server.base_url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == origin
    other = httpx.get(f"{server.base_url}/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
