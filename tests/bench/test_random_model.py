"""bench.random_model writes a loadable random model of the default model's layout:
a Llama, or a Qwen2 whose qkv biases are drawn (not transformers' zeros), which the
engine loads and runs."""

from __future__ import annotations

import pytest
import torch

from bench.random_model import main, save_tokenizer, write_random_model
from engine import GenerationConfig, load_model

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_written_models_load_and_generate(tmp_path, family):
    path = write_random_model(str(tmp_path / family), family=family, vocab_size=256, **SMALL)
    model = load_model(path, dtype="float32", progress=False)
    assert model.config.model_type == family
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    biases = [p for name, p in model.module.named_parameters() if name.endswith("bias")]
    if family == "qwen2":
        assert biases and all(b.abs().sum() > 0 for b in biases)
    else:
        assert not biases
    outputs = model.generate_batch([[5, 6, 7]], GenerationConfig(max_new_tokens=4, eos_token_id=[]))
    assert len(next(iter(outputs.values())).generated_tokens) == 4


def test_the_cli_refuses_an_unknown_family(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--family", "gpt2"])
    with pytest.raises(ValueError, match="family"):
        write_random_model(str(tmp_path / "y"), family="gpt2", vocab_size=256, **SMALL)


def test_the_default_tokenizer_travels_to_a_random_model(tmp_path):
    """--tokenizer-only writes the default model's tokenizer alone; a random model made
    with it then loads with that tokenizer and its chat template (what a server needs)."""
    carried = tmp_path / "tokenizer"
    main([str(carried), "--tokenizer", "smollm2-135m-instruct", "--tokenizer-only"])
    assert (carried / "tokenizer_config.json").is_file()
    assert not (carried / "config.json").exists()            # no weights, no config
    path = write_random_model(str(tmp_path / "model"), **SMALL, vocab_size=49152)
    save_tokenizer(str(carried), path)
    model = load_model(path, progress=False)
    chat = model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                               tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in chat
    assert model.tokenizer.decode(model.tokenizer.encode("a cat")) == "a cat"
    with pytest.raises(SystemExit):
        main([str(tmp_path / "z"), "--tokenizer-only"])
