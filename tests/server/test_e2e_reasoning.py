"""End to end: a thinking model with a Hermes-style tool template. A tiny random
Qwen3 over the default model's tokenizer, served with `--chat-template` (a template
that knows <think>, `enable_thinking` and <tool_call>): the reasoning is split off,
`chat_template_kwargs` reaches the template, and under a grammar the answer after
the thinking still parses."""

import json

import httpx
import pytest

from tests.server.conftest import launch_server

pytestmark = pytest.mark.slow

NAME = "tiny-thinker"
TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call functions:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Write each call as <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>
{{ c.function | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"]}}}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from engine.loading.model_files import resolve_model_dir

    path = tmp_path_factory.mktemp("tiny-thinker")
    torch.manual_seed(11)
    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=1024, eos_token_id=2,
                         bos_token_id=1, tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct"))).save_pretrained(path)
    template = path / "template.jinja"
    template.write_text(TEMPLATE)
    yield from launch_server(tmp_path_factory, [
        "--model", str(path), "--served-model-name", NAME, "--chat-template", str(template),
        "--api-key", "k", "--page-size", "16", "--num-blocks", "128"], api_key="k")


def chat(server, **body):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Is it sunny?"}],
            "max_tokens": 60, **body}
    response = httpx.post(f"{server.openai_base_url}/chat/completions",
                          headers=server.headers(), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_the_card_reports_hermes_tools_and_reasoning(thinker):
    card = httpx.get(f"{thinker.openai_base_url}/models", headers=thinker.headers()).json()
    assert card["data"][0]["tool_parser"] == "hermes" and card["data"][0]["reasoning"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_thinking_is_split_and_the_answer_after_it_parses(thinker, seed):
    choice = chat(thinker, response_format={"type": "json_schema", "json_schema": {
        "name": "verdict", "schema": SCHEMA}}, temperature=1.0, seed=seed)
    message = choice["message"]
    assert isinstance(message["reasoning_content"], str) and "<think>" not in message["content"]
    assert json.loads(message["content"])["answer"] in ("yes", "no")


def test_enable_thinking_false_reaches_the_template(thinker):
    response = httpx.post(f"{thinker.base_url}/tokenize", headers=thinker.headers(),
                          json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
    plain = response.json()["count"]
    choice = chat(thinker, chat_template_kwargs={"enable_thinking": False},
                  response_format={"type": "json_object"}, max_tokens=30)
    assert choice["message"].get("reasoning_content") is None
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert plain > 0


def test_required_tool_calls_after_thinking_streamed_and_not(thinker):
    choice = chat(thinker, tools=[WEATHER], tool_choice="required", max_tokens=80)
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    assert isinstance(choice["message"]["reasoning_content"], str)

    body = {"model": NAME, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [WEATHER], "tool_choice": "required", "max_tokens": 80, "stream": True}
    reasoning, arguments, finish = "", "", None
    with httpx.stream("POST", f"{thinker.openai_base_url}/chat/completions",
                      headers=thinker.headers(), json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for part in json.loads(line[6:])["choices"]:
                delta = part["delta"]
                reasoning += delta.get("reasoning_content") or ""
                for call in delta.get("tool_calls") or []:
                    arguments += call["function"].get("arguments") or ""
                finish = part["finish_reason"] or finish
    assert finish == "tool_calls" and isinstance(json.loads(arguments)["city"], str)
    assert "</think>" not in reasoning


def test_anthropic_messages_carry_thinking_blocks(thinker):
    """The same thinking model through /v1/messages: the reasoning is a `thinking`
    block before the tool_use, whole and streamed (thinking_delta, then
    input_json_delta in a block of its own); `thinking: disabled` reaches the template."""
    import anthropic

    client = anthropic.Anthropic(base_url=thinker.base_url, api_key="k", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
    ask = {"model": "claude-any", "max_tokens": 80, "tools": tools,
           "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "Weather?"}]}
    message = client.messages.create(**ask)
    kinds = [block.type for block in message.content]
    assert kinds[0] == "thinking" and "tool_use" in kinds and message.stop_reason == "tool_use"
    assert "</think>" not in message.content[0].thinking
    with client.messages.stream(**ask) as stream:
        deltas = [(event.index, event.delta.type) for event in stream
                  if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas[0] == (0, "thinking_delta")
    assert {kind for index, kind in deltas if index > 0} == {"input_json_delta"}
    assert final.content[0].type == "thinking" and final.content[-1].type == "tool_use"
    plain = client.messages.create(model="m", max_tokens=20, thinking={"type": "disabled"},
                                   messages=[{"role": "user", "content": "hi"}])
    assert [block.type for block in plain.content] in (["text"], [])
