"""Constrained decoding on the default model (real tokenizer): masks change nothing
the grammar already allows, every constrained output matches its grammar (closing
in time when the budget runs short), and matchers survive preemption, prefix hits,
sampling and batches shared with free requests."""

import json
import re

import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.errors import InvalidRequestError
from engine.structured.grammar import GrammarSpec
from engine.structured.grammar_masks import _fix_eos, apply_masks

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]},
                                  "maxItems": 3}}}
QUESTIONS = ["Describe a person as JSON.", "What is the capital of France?",
             "Write a haiku about the sea.", "List three primary colors.",
             "Give me a JSON object about a cat.", "Count from one to ten."]


@pytest.fixture(scope="module")
def model():
    return load_model("smollm2-135m-instruct", progress=False)


def chat(model, text):
    rendered = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return model.tokenizer.encode(rendered, add_special_tokens=False)


def generate(model, prompts, max_new_tokens=40, config=None, **kwargs):
    outputs = model.generate_batch(prompts, GenerationConfig(max_new_tokens=max_new_tokens),
                                   config, **kwargs)
    return list(outputs.values())


def valid_person(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "tags"} and isinstance(value["name"], str)
            and len(value["name"]) <= 20 and isinstance(value["age"], int)
            and len(value["tags"]) <= 3 and set(value["tags"]) <= {"red", "blue"})


def test_masks_keep_what_the_grammar_allows(model):
    """Greedy output under a grammar the free output satisfies is the free output."""
    prompts = [chat(model, q) for q in QUESTIONS]
    free = generate(model, prompts, max_new_tokens=24)
    no_angle = GrammarSpec("regex", r"[^<>]*")        # free answers never spell < or >
    assert not any({"<", ">"} & set(model.tokenizer.decode(o.generated_tokens[:-1]))
                   for o in free)
    constrained = generate(model, prompts, max_new_tokens=24, grammar=no_angle)
    assert [o.generated_tokens for o in constrained] == [o.generated_tokens for o in free]


def test_json_schema_outputs_validate_beside_free_requests(model):
    prompts = [chat(model, q) for q in QUESTIONS]
    manager = model.init_continuous_batching(GenerationConfig(max_new_tokens=60))
    manager.start()
    try:
        compiled = manager.compile_grammar(GrammarSpec("json_schema", PERSON))
        ids = []
        for i, prompt in enumerate(prompts * 2):
            grammar = compiled if i % 2 == 0 else None
            ids.append((manager.add_request(prompt, do_sample=i % 4 == 0, temperature=1.2,
                                            seed=i, grammar=grammar), grammar))
        results = {rid: None for rid, _ in ids}
        while any(v is None for v in results.values()):
            output = manager.get_result(timeout=60)
            assert output is not None
            results[output.request_id] = output
    finally:
        manager.stop()
    for rid, grammar in ids:
        text = model.tokenizer.decode(results[rid].generated_tokens, skip_special_tokens=True)
        if grammar is not None:
            assert results[rid].finish_reason == "stop" and valid_person(text), text


@pytest.mark.parametrize("spare", [0, 3, 9])
def test_short_budgets_still_close_the_json(model, spare):
    """With a budget the closing path fits in, sampled outputs still complete."""
    manager = model.init_continuous_batching()
    compiled = manager.compile_grammar(GrammarSpec("json_schema", PERSON))
    manager.destroy()
    shortest = compiled.new_matcher((2,))._path_to_completion(64)
    assert valid_person(model.tokenizer.decode(shortest))
    budget = len(shortest) + spare
    prompts = [chat(model, q) for q in QUESTIONS[:3]]
    outputs = generate(model, prompts, max_new_tokens=budget, do_sample=True, temperature=1.5,
                       seed=7, grammar=compiled)
    for output in outputs:
        assert len(output.generated_tokens) <= budget
        assert valid_person(model.tokenizer.decode(output.generated_tokens)), output


def test_ignore_eos_and_extra_stop_ids_follow_the_request(model):
    """The grammar's EOS is the model's; a request without EOS ids ends on the
    grammar alone, one with another stop id may end on it only where the grammar
    is complete."""
    prompt = chat(model, "Answer yes or no: is the sky blue?")
    yes_no = GrammarSpec("regex", "(yes|no)")
    manager = model.init_continuous_batching(GenerationConfig(max_new_tokens=8))
    manager.start()
    try:
        none = manager.add_request(prompt, eos_token_id=[], grammar=yes_no)
        comma = model.tokenizer.encode(",", add_special_tokens=False)[0]
        other = manager.add_request(prompt, eos_token_id=[comma],
                                    grammar=GrammarSpec("regex", "(yes|no)!*"))
        outputs = {rid: manager.get_result(rid, timeout=60) for rid in (none, other)}
    finally:
        manager.stop()
    assert model.tokenizer.decode(outputs[none].generated_tokens) in ("yes", "no")
    assert outputs[none].finish_reason == "stop"
    tokens = outputs[other].generated_tokens
    text = model.tokenizer.decode(tokens)
    assert re.fullmatch("(yes|no)!*,?", text) and 2 not in tokens, text
    assert (outputs[other].finish_reason == "stop") == text.endswith(","), text


@pytest.fixture(scope="module")
def tiny_with_tokenizer(model, tmp_path_factory):
    """A tiny random Llama over the default model's tokenizer: fp32 steps whose
    tokens do not depend on how requests are batched, so runs compare exactly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=2, bos_token_id=1,
                         initializer_range=0.2)     # logits far apart: no near ties
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    LlamaForCausalLM(config).save_pretrained(path)
    model.tokenizer.save_pretrained(path)
    return load_model(path, progress=False)


@pytest.mark.parametrize("offload", [0, 0.01])
def test_matchers_survive_preemption_and_prefix_hits(model, tiny_with_tokenizer, offload):
    prompts = [chat(model, q) for q in QUESTIONS] * 2           # repeats hit the prefix cache
    spec = GrammarSpec("json_schema", PERSON)
    roomy = generate(tiny_with_tokenizer, prompts, 40, ContinuousBatchingConfig(
        page_size=16, num_blocks=256, max_batch_tokens=64), grammar=spec)
    tight = ContinuousBatchingConfig(page_size=16, num_blocks=24, max_batch_tokens=64,
                                     cpu_offload_space=offload)
    manager = tiny_with_tokenizer.init_continuous_batching(GenerationConfig(max_new_tokens=40),
                                                           tight)
    with_preemption = {}
    manager.start()
    try:
        compiled = manager.compile_grammar(spec)
        ids = [manager.add_request(p, grammar=compiled) for p in prompts]
        for _ in ids:
            output = manager.get_result(timeout=120)
            with_preemption[output.request_id] = output.generated_tokens
        stats = manager.stats()
    finally:
        manager.stop()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert bool(stats["num_swapped_out"]) == bool(offload)
    assert [with_preemption[i] for i in ids] == [o.generated_tokens for o in roomy]
    assert all(valid_person(model.tokenizer.decode(o.generated_tokens)) for o in roomy)


def test_bad_grammars_are_refused_by_name(model):
    manager = model.init_continuous_batching()
    try:
        with pytest.raises(InvalidRequestError, match="does not exist"):
            manager.compile_grammar(GrammarSpec("json_schema", {"$ref": "#/$defs/missing"}))
        with pytest.raises(InvalidRequestError, match="unclosed character class"):
            manager.add_request([1, 2], grammar=GrammarSpec("regex", "[a-"))
        with pytest.raises(InvalidRequestError, match="grammar.kind"):
            GrammarSpec("yaml", "x")
        assert manager.stats()["num_waiting"] == 0
    finally:
        manager.destroy()


def test_apply_masks_equals_a_per_token_loop():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 70, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=generator)
    rows = [1, 4]
    masked = apply_masks(logits, rows, bitmask)
    expected = logits.clone()
    for k, row in enumerate(rows):
        for token in range(70):
            if not (int(bitmask[k, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(masked, expected)
    assert not torch.equal(masked, logits)


def test_eos_fix_swaps_the_grammar_eos_for_the_request_eos():
    words = torch.tensor([0b100, 0], dtype=torch.int32)
    _fix_eos(words, ((2,), (33, 63)), eos_allowed=True)
    allowed = [t for t in range(64) if (int(words[t // 32]) >> (t % 32)) & 1]
    assert allowed == [33, 63]
    _fix_eos(words, ((2,), (33, 63)), eos_allowed=False)
    assert [t for t in range(64) if (int(words[t // 32]) >> (t % 32)) & 1] == [33, 63]


def test_regex_outputs_match(model):
    prompts = [chat(model, q) for q in QUESTIONS[:4]]
    pattern = r"(yes|no), because [a-z ]{1,40}\."
    for output in generate(model, prompts, max_new_tokens=40, grammar=GrammarSpec("regex", pattern)):
        text = model.tokenizer.decode(output.generated_tokens, skip_special_tokens=True)
        assert re.fullmatch(pattern, text) and output.finish_reason == "stop", text


def test_speculation_under_a_grammar_keeps_the_plain_tokens(model):
    """Suffix decoding proposes the first round's answers in the second: only drafts
    the grammar accepts are fed, each verify row is masked as plain decoding masks
    it, and the tokens (greedy) are those of plain decoding, outputs valid."""
    prompts = [chat(model, q) for q in QUESTIONS[:4]]
    spec = GrammarSpec("json_schema", PERSON)
    config = GenerationConfig(max_new_tokens=120)
    plain = [o.generated_tokens for o in generate(model, prompts, 120, grammar=spec)]
    manager = model.init_continuous_batching(config, ContinuousBatchingConfig(
        speculative_config={"method": "suffix", "num_speculative_tokens": 6}))
    manager.start()
    try:
        compiled = manager.compile_grammar(spec)
        for _ in range(2):
            ids = [manager.add_request(p, grammar=compiled) for p in prompts]
            outputs = {}
            while len(outputs) < len(ids):
                output = manager.get_result(timeout=120)
                outputs[output.request_id] = output
            assert [outputs[i].generated_tokens for i in ids] == plain
        stats = manager.stats()
    finally:
        manager.stop()
    assert all(valid_person(model.tokenizer.decode(t)) for t in plain)
    assert stats["spec_num_accepted_tokens"] > 20, stats



def _binary_tree(depth):
    schema = {"type": "string"}
    for _ in range(depth):        # the same subtree twice: 2**depth leaves once expanded
        schema = {"type": "object", "properties": {"a": schema, "b": schema},
                  "required": ["a", "b"]}
    return schema


HUGE = {
    "a tree of 16,384 leaves": (_binary_tree(14), "schema too large"),
    "500 nested arrays": ('{"type": "array", "items": ' * 500 + '{"type": "string"}'
                          + "}" * 500, "recursion limit exceeded"),
    "an enum of 100,000 strings": ({"enum": [f"value-{i}" for i in range(100_000)]},
                                   "too big"),
    "20,000 properties": ({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(20_000)}}, "schema too large"),
}


@pytest.mark.parametrize("name", sorted(HUGE))
def test_grammars_too_large_to_compile_are_refused_quickly(model, name):
    """llguidance's limits (grammar size, lexer fuel, nesting) bound a compile; the
    server runs compiles off the event loop (structured_output.py), so one that
    takes its time stalls no other request."""
    import time

    schema, reason = HUGE[name]
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match=reason):
        model.grammars.compile(GrammarSpec("json_schema", schema))
    assert time.monotonic() - started < 10.0
