"""Chat templates run in transformers' sandboxed Jinja environment, whichever source
they come from (a GGUF, tokenizer_config.json, `--chat-template`: all render through
ChatFormat.render): a template reaching for Python internals to run a command fails
with a 400 naming the template's refusal, and the command never runs."""

from __future__ import annotations

import pytest

from server.chat_format import build_chat_format
from server.errors import OpenAIError

ESCAPES = [
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ joiner.__init__.__globals__['os'].system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__.__builtins__.open('MARKER', 'w').write('x') }}",
]


@pytest.fixture(scope="module")
def tokenizer():
    from engine.loading import load_tokenizer, resolve_model_dir

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
