"""`python -m server --speculative-config '{"method": "ngram", ...}'` on the default
model: a greedy chat answer that quotes its prompt is the same with speculation and
without it (`"speculative": false` in the body), streamed too; /metrics counts the
drafts vLLM's way and /v1/models names the method."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import API_KEY, ENGINE_FLAGS, launch_server

CODE = ("def merge_sorted(a, b):\n    result = []\n    i = j = 0\n"
        "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
        "            result.append(a[i])\n            i += 1\n        else:\n"
        "            result.append(b[j])\n            j += 1\n    return result\n")
PROMPT = "Repeat this code exactly:\n\n" + CODE
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def speculative_server(tmp_path_factory):
    yield from launch_server(tmp_path_factory, ["--api-key", API_KEY, "--speculative-config",
                                                json.dumps(SPEC), "--log-level", "info",
                                                *ENGINE_FLAGS])


def _chat(server, **extra) -> dict:
    body = {"model": "smollm2-135m-instruct", "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}],
            **extra}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _counters(server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return {line.split("{")[0] + ("@" + line.split('position="')[1].split('"')[0]
                                  if 'position="' in line else ""):
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:spec_decode_")}


def test_answers_match_with_and_without_drafts(speculative_server):
    before = _counters(speculative_server)
    plain = _chat(speculative_server, speculative=False)
    assert _counters(speculative_server) == before             # opted out: no drafts
    drafted = _chat(speculative_server)
    after = _counters(speculative_server)
    assert drafted["choices"][0]["message"]["content"] == \
        plain["choices"][0]["message"]["content"]
    assert drafted["usage"] == plain["usage"]
    drafts = after["vllm:spec_decode_num_drafts_total"] - before.get(
        "vllm:spec_decode_num_drafts_total", 0)
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"] - before.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0)
    assert drafts > 0 and accepted > 0
    assert after["vllm:spec_decode_num_draft_tokens_total"] >= accepted
    per_position = [after[f"vllm:spec_decode_num_accepted_tokens_per_pos_total@{i}"]
                    for i in range(4) if f"vllm:spec_decode_num_accepted_tokens_per_pos_total@{i}"
                    in after]
    assert sum(per_position) == after["vllm:spec_decode_num_accepted_tokens_total"]
    assert per_position == sorted(per_position, reverse=True)   # a later one needs the earlier
    log = speculative_server.log_path.read_text(errors="replace")
    rates = [float(line.split("spec_acceptance=")[1].split()[0]) for line in log.splitlines()
             if "spec_acceptance=" in line]
    assert rates and all(0.0 <= rate <= 1.0 for rate in rates)      # the drafted request's


def test_streams_the_same_text(speculative_server):
    plain = _chat(speculative_server, speculative=False)["choices"][0]["message"]["content"]
    body = {"model": "smollm2-135m-instruct", "max_tokens": 64, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": PROMPT}]}
    pieces = []
    with httpx.stream("POST", f"{speculative_server.base_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    assert "".join(pieces) == plain


def test_each_of_n_choices_is_the_plain_answer(speculative_server):
    plain = _chat(speculative_server, speculative=False)["choices"][0]["message"]["content"]
    choices = _chat(speculative_server, n=2)["choices"]
    assert [c["message"]["content"] for c in choices] == [plain, plain]


def test_tool_calls_are_the_same_with_drafts(speculative_server):
    """The call's arguments are constrained by a grammar: drafts are cut to what it
    accepts and each verify row is masked (engine/structured/grammar_masks.py)."""
    from bench.tool_loop import QUESTION, TOOLS

    answers = [_chat(speculative_server, messages=[{"role": "user", "content": QUESTION}],
                     tools=TOOLS, tool_choice="required", max_tokens=120, **extra)
               for extra in ({"speculative": False}, {})]
    calls = [[call["function"] for call in a["choices"][0]["message"]["tool_calls"]]
             for a in answers]
    assert calls[0] == calls[1] and calls[0][0]["name"] == "get_weather"
    assert answers[0]["usage"] == answers[1]["usage"]


def test_models_name_the_method(speculative_server):
    card = httpx.get(f"{speculative_server.base_url}/v1/models", timeout=30,
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]
    assert card["speculative_decoding"]["method"] == "ngram"
    assert card["speculative_decoding"]["num_speculative_tokens"] == 4


def test_a_bad_setting_stops_the_server_naming_it(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "server", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 0}'],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "speculative_config.num_speculative_tokens must be an integer >= 1" in done.stderr


def test_bench_serve_runs_each_level_without_and_with_drafts(speculative_server):
    from bench.serve import main

    before = _counters(speculative_server)
    report = main(["--base-url", speculative_server.base_url, "--api-key", API_KEY,
                   "--workload", "grounded", "--speculative", "off,on", "--concurrency", "2",
                   "--num-requests", "2", "--output-len", "24"])
    assert [level["speculative"] for level in report["levels"]] == ["off", "on"]
    assert all(level["errors"] == 0 and level["output_tokens"] == 2 * 24
               for level in report["levels"])
    assert report["workload"]["kind"] == "grounded"
    assert _counters(speculative_server)["vllm:spec_decode_num_drafts_total"] > \
        before["vllm:spec_decode_num_drafts_total"]
    loops = main(["--base-url", speculative_server.base_url, "--api-key", API_KEY,
                  "--workload", "toolloop", "--speculative", "off,on", "--concurrency", "1",
                  "--num-requests", "2", "--output-len", "96"])
    assert all(level["errors"] == 0 and level["output_tokens"] > 2 * 10
               for level in loops["levels"])
    assert loops["levels"][0]["output_tokens"] == loops["levels"][1]["output_tokens"]
