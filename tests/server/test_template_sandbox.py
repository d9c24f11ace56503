"""Chat templates run in transformers' sandboxed Jinja environment, whichever source
they come from (a GGUF, tokenizer_config.json, `--chat-template`: all render through
ChatFormat.render): a template reaching for Python internals to run a command fails
with a 400 naming the template's refusal, and the command never runs."""

from __future__ import annotations

import pytest

from server.text_pipeline.chat_format import build_chat_format
from server.edge.errors import OpenAIError

ESCAPES = [
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ joiner.__init__.__globals__['os'].system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__.__builtins__.open('MARKER', 'w').write('x') }}",
]


@pytest.fixture(scope="module")
def tokenizer():
    from engine.loading.model_files import load_tokenizer, resolve_model_dir

    return load_tokenizer(resolve_model_dir("smollm2-135m-instruct"))


@pytest.mark.parametrize("template", ESCAPES)
def test_an_escape_attempt_is_refused_and_runs_nothing(tokenizer, template, tmp_path,
                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "template.jinja"
    path.write_text(template)
    chat_format = build_chat_format(tokenizer, str(path), "auto")
    with pytest.raises(OpenAIError) as refused:
        chat_format.render(tokenizer, [{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 400
    assert "The chat template rejected the messages" in refused.value.message
    assert "unsafe" in refused.value.message or "undefined" in refused.value.message
    assert not (tmp_path / "MARKER").exists()


# Templates that loop or grow without end on one kind of message (so they pass the
# start-up probe) and render normally otherwise.
RUNAWAYS = {
    "loops": ("{% set r = range(100000)|list %}{% for m in messages %}"
              "{% if 'runaway' in m.content %}{% for a in r %}{% for b in r %}{% endfor %}"
              "{% endfor %}{% endif %}{{ m.content }}{% endfor %}",
              "was stopped: the chat template ran longer than"),
    "grows": ("{% for m in messages %}{% if 'runaway' in m.content %}"
              "{% for i in range(100000) %}{{ (m.content ~ i) * 2000000 }}{% endfor %}{% endif %}"
              "{{ m.content }}{% endfor %}", "was stopped: the chat template grew the server's memory"),
    "explodes": ("{% for m in messages %}{% if 'runaway' in m.content %}"
                 "{% for i in range(100000) %}{{ 'x' * 20000000 }}{% endfor %}{% endif %}"
                 "{{ m.content }}{% endfor %}", "was stopped: its output does not fit"),
    "recurses": ("{% macro deeper(n) %}{{ deeper(n + 1) }}{{ deeper(n + 1) }}{% endmacro %}"
                 "{% for m in messages %}{% if 'runaway' in m.content %}{{ deeper(0) }}"
                 "{% endif %}{{ m.content }}{% endfor %}", "maximum recursion depth"),
}


@pytest.mark.parametrize("kind", sorted(RUNAWAYS))
def test_a_runaway_template_is_stopped_within_its_bounds(tokenizer, kind, tmp_path):
    import time

    from server.text_pipeline.template_bounds import resident_bytes

    template, reason = RUNAWAYS[kind]
    path = tmp_path / "template.jinja"
    path.write_text(template)
    chat_format = build_chat_format(tokenizer, str(path), "auto")     # the probe passes
    assert chat_format.render(tokenizer, [{"role": "user", "content": "hi"}]) == "hi"
    before, started = resident_bytes(), time.monotonic()
    with pytest.raises(OpenAIError) as stopped:
        chat_format.render(tokenizer, [{"role": "user", "content": "runaway"}])
    assert time.monotonic() - started < chat_format.bounds.seconds + 1.5
    assert stopped.value.status_code == 400 and stopped.value.param == "messages"
    assert reason in stopped.value.message
    assert resident_bytes() - before < 2 * chat_format.bounds.max_growth_bytes
    assert chat_format.render(tokenizer, [{"role": "user", "content": "again"}]) == "again"


def test_a_template_that_runs_away_on_every_message_is_refused_at_start(tokenizer, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% set r = range(100000)|list %}{% for a in r %}{% for b in r %}"
                    "{% endfor %}{% endfor %}{{ messages[0].content }}")
    with pytest.raises(ValueError, match="chat template refused at start: .*ran longer"):
        build_chat_format(tokenizer, str(path), "auto")


def test_the_bound_leaves_normal_renders_and_tracing_as_they_were(tokenizer):
    import sys

    chat_format = build_chat_format(tokenizer, None, "auto")
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    previous = sys.gettrace()
    assert chat_format.render(tokenizer, messages) == expected
    assert sys.gettrace() is previous
