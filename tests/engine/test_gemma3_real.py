"""The real Gemma 3 270M (GGUF Q4_K_M from PyPI, sliding window 512): our engine's
greedy continuation of a prompt longer than the window equals transformers'."""

import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.loading.model_files import pretrained_arguments

pytestmark = pytest.mark.slow

PARAGRAPH = (
    "The harbour town woke slowly. Fishermen checked their nets, bakers pulled the first "
    "loaves from stone ovens, and the ferry captain counted passengers twice because the "
    "ledger never matched. Gulls argued over scraps near the market, where a teacher "
    "bought apples for a class that would study orchards that afternoon. {n} "
)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma():
    model = load_model("gemma3-270m", progress=False)
    return model, model.tokenizer


def test_config_is_hybrid_with_a_512_window(gemma):
    model, _ = gemma
    assert model.config.model_type == "gemma3_text"
    assert model.module.sliding_window == 512
    assert any(model.module.layer_is_sliding) and not all(model.module.layer_is_sliding)


def test_greedy_beyond_the_window_matches_transformers(gemma):
    from transformers import AutoModelForCausalLM

    model, tokenizer = gemma
    text = "".join(PARAGRAPH.format(n=f"Day {i} ended quietly.") for i in range(12))
    prompt = tokenizer(text)["input_ids"]
    assert len(prompt) > 600
    outputs = model.generate_batch(
        [prompt, prompt[:300]], GenerationConfig(max_new_tokens=NEW_TOKENS, eos_token_id=[]),
        ContinuousBatchingConfig(page_size=64, max_batch_tokens=256))
    # transformers on the same file, dequantized by its own GGUF loader
    path, where = pretrained_arguments("gemma3-270m")
    reference = AutoModelForCausalLM.from_pretrained(path, **where, dtype=torch.float32).eval()
    for ids, output in zip([prompt, prompt[:300]], outputs.values()):
        tensor = torch.tensor([ids])
        with torch.inference_mode():
            want = reference.generate(tensor, attention_mask=torch.ones_like(tensor),
                                      do_sample=False, max_new_tokens=NEW_TOKENS,
                                      min_new_tokens=NEW_TOKENS)
        assert output.generated_tokens == want[0, len(ids):].tolist()
