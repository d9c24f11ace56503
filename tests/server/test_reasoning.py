"""The <think> split: whole answers and the same answers streamed in two pieces
split at every character, the block opened by the model or by the prompt."""

import pytest

from server.text_pipeline.reasoning import ReasoningSplit, prompt_opens_thinking

CASES = [
    # opened by the prompt, answer, reasoning, content
    (False, "<think>\nweigh a, then b.\n</think>\n\nThe answer is 4.", "weigh a, then b.",
     "The answer is 4."),
    (False, "No thinking here, just <b>text</b>.", None, "No thinking here, just <b>text</b>."),
    (False, "<think>never closed", "never closed", ""),
    (True, "still thinking</think>{\"a\": 1}", "still thinking", '{"a": 1}'),
    (True, "</think>Direct.", "", "Direct."),
]


@pytest.mark.parametrize("opened, answer, reasoning, content", CASES)
def test_whole_answers(opened, answer, reasoning, content):
    assert ReasoningSplit(opened).split(answer) == (reasoning, content)


@pytest.mark.parametrize("opened, answer, reasoning, content", CASES)
def test_streamed_answers_split_anywhere(opened, answer, reasoning, content):
    for pieces in [[answer[:cut], answer[cut:]] for cut in range(len(answer) + 1)] + [list(answer)]:
        stream = ReasoningSplit(opened).stream()
        parts = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
        got_reasoning = "".join(t for kind, t in parts if kind == "reasoning")
        got_content = "".join(t for kind, t in parts if kind == "content")
        assert got_reasoning.strip() == (reasoning or ""), pieces
        assert got_content == content, pieces


def test_prompt_that_leaves_a_block_open():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def test_every_grammar_kind_follows_the_thinking(tokenizer):
    from engine.structured.grammar import GrammarCompiler, GrammarSpec
    from server.text_pipeline.reasoning import after_thinking

    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    specs = {"json_schema": GrammarSpec("json_schema", {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}),
             "json_object": GrammarSpec("json_object"),
             "regex": GrammarSpec("regex", "(yes|no)/maybe"),
             "lark": GrammarSpec("lark", 'start: "ok"')}
    answers = {"json_schema": '{"a":3}', "json_object": '{"b":1}', "regex": "no/maybe",
               "lark": "ok"}
    for kind, spec in specs.items():
        matcher = compiler.compile(after_thinking(spec, False)).new_matcher(
            (tokenizer.eos_token_id,))
        for token in tokenizer.encode(f"<think>hmm</think>\n{answers[kind]}",
                                      add_special_tokens=False):
            matcher.accept(token)
        assert matcher.error is None and matcher.eos_allowed(), kind
