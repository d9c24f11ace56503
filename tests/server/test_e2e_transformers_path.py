"""The server over a family we have no code for (a tiny random Phi-3 with the default
model's tokenizer): it starts, says which path serves, and answers chat and
completions with transformers' greedy tokens."""

import httpx
import pytest
import torch

from tests.server.conftest import launch_server

NAME = "tiny-phi3"


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, tokenizer):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    reference = Phi3ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("phi3")
    reference.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, reference


@pytest.fixture(scope="module")
def phi3_server(tmp_path_factory, phi3):
    path, _ = phi3
    yield from launch_server(tmp_path_factory, [
        "--model", str(path), "--served-model-name", NAME, "--log-level", "info",
        "--page-size", "16", "--num-blocks", "64"])


def test_the_log_names_the_path(phi3_server):
    assert "'phi3' runs on transformers' modeling code" in phi3_server.log_tail()


def test_completions_equal_transformers_greedy(phi3_server, phi3, tokenizer):
    _, reference = phi3
    prompt = tokenizer.encode("The sea is")
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                                      pad_token_id=0)[0, len(prompt):]
    response = httpx.post(f"{phi3_server.base_url}/v1/completions", headers=phi3_server.headers(),
                          json={"model": NAME, "prompt": prompt, "max_tokens": 10,
                                "temperature": 0}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == tokenizer.decode(expected,
                                                                     skip_special_tokens=True)


def test_chat_streams(phi3_server):
    body = {"model": NAME, "max_tokens": 12, "stream": True,
            "messages": [{"role": "user", "content": "Hello there"}]}
    with httpx.stream("POST", f"{phi3_server.base_url}/v1/chat/completions",
                      headers=phi3_server.headers(), json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
