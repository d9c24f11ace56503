"""The per-request log line: logfmt that splits back into the same fields, and
text only when asked for."""

from server.request_log import RequestRecord, format_logfmt
from tests.server.test_e2e_limits import parse_logfmt


def record() -> RequestRecord:
    r = RequestRecord("POST", "/v1/chat/completions", arrival=10.0)
    r.request_id, r.stream, r.prompt_tokens, r.completion_tokens = "chatcmpl-1", True, 12, 3
    r.first_token_time = 10.25
    r.finish_reasons = ["length"]
    r.prompt_text = 'say "hi" = now'
    r.add_output_text(0, "hi ")
    r.add_output_text(0, "there")
    return r


def test_fields_without_text():
    fields = record().fields(200, log_prompts=False)
    assert list(fields)[:4] == ["id", "method", "path", "status"]
    assert fields["ttft_ms"] == 250.0 and "prompt" not in fields and "output" not in fields
    assert "error" not in fields  # absent values are left out


def test_text_only_when_asked_and_quoted_safely():
    fields = record().fields(200, log_prompts=True)
    assert fields["prompt"] == 'say "hi" = now' and fields["output"] == ["hi there"]
    line = format_logfmt(fields)
    parsed = parse_logfmt(line)
    assert parsed["prompt"] == 'say "hi" = now'
    assert parsed["status"] == "200" and parsed["stream"] == "true"
    assert parsed["id"] == "chatcmpl-1"


def test_logfmt_values():
    assert format_logfmt({"a": 1, "b": "x y", "c": False, "d": ""}) == 'a=1 b="x y" c=false d=""'
