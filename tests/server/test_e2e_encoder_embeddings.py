"""An encoder embedding model (a tiny random BertModel saved as a sentence-transformers
checkpoint: modules.json, 1_Pooling/config.json with mean pooling, a Normalize
module) served by `python -m server --model DIR` (engine/encoder): the task is
inferred as "embed"; /v1/embeddings through the openai SDK equals transformers'
mean-pooled, normalised `last_hidden_state` on the same weights, in input order,
batches of unequal lengths included; generation routes and rerank answer 400, and
`--task generate` stops the server at start."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
import torch

from tests.server.conftest import API_KEY, REPO_ROOT, launch_server

NAME = "tiny-bert"
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat",
         "a", "dog", "ran", "paged", "attention", "keeps", "blocks", "of", "keys", "and",
         "values", "hello", "world", "."]
TEXTS = ["the cat sat on the mat .", "hello", "paged attention keeps blocks of keys and values .",
         "a dog ran", "the cat sat on the mat ."]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = tmp_path_factory.mktemp("bert")
    (path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    tokenizer = BertTokenizerFast(str(path / "vocab.txt"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS), hidden_size=48, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=96,
                        max_position_embeddings=64)
    reference = BertModel(config).eval()
    reference.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 48, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}))
    return path, reference, tokenizer


@pytest.fixture(scope="module")
def bert_server(tmp_path_factory, bert):
    path, _, _ = bert
    yield from launch_server(tmp_path_factory, [
        "--model", str(path), "--served-model-name", NAME, "--api-key", API_KEY,
        "--max-batch-tokens", "24"])


@pytest.fixture(scope="module")
def sdk(bert_server):
    return openai.OpenAI(base_url=bert_server.openai_base_url, api_key=API_KEY, max_retries=0)


def expected(bert, text: str) -> torch.Tensor:
    _, reference, tokenizer = bert
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = reference(ids).last_hidden_state[0].double()
    return torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)


def test_vectors_match_transformers_mean_pooling_in_order(sdk, bert):
    data = sdk.embeddings.create(model=NAME, input=TEXTS, encoding_format="float").data
    assert [item.index for item in data] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, data):
        got = torch.tensor(item.embedding, dtype=torch.float64)
        assert got.shape == (48,) and abs(got.norm().item() - 1.0) < 1e-5
        assert torch.nn.functional.cosine_similarity(got, expected(bert, text), dim=0) >= 0.999
    assert data[0].embedding == pytest.approx(data[4].embedding, abs=1e-6)   # other padding
    assert data[0].embedding != data[1].embedding


def test_base64_and_concurrent_requests(bert_server, sdk, bert):
    import concurrent.futures

    def embed(text):
        return sdk.embeddings.create(model=NAME, input=text).data[0].embedding   # base64
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        vectors = list(pool.map(embed, TEXTS * 2))
    for text, vector in zip(TEXTS * 2, vectors):
        got = torch.tensor(vector, dtype=torch.float64)
        assert torch.nn.functional.cosine_similarity(got, expected(bert, text), dim=0) >= 0.999
    stats = httpx.get(f"{bert_server.base_url}/health", timeout=10).json()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/responses", {"input": "hello"}),
])
def test_generation_routes_answer_400(bert_server, route, body):
    reply = httpx.post(f"{bert_server.base_url}{route}", headers=bert_server.headers(),
                       json={"model": NAME, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "embedding model" in error["message"] and error["param"] == "model"


def test_chat_through_the_sdk_is_refused(sdk):
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        sdk.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])


def test_rerank_without_a_head_and_limits(bert_server):
    def post(route, body):
        return httpx.post(f"{bert_server.base_url}{route}", headers=bert_server.headers(),
                          json={"model": NAME, **body}, timeout=30)
    rerank = post("/v1/rerank", {"query": "cat", "documents": ["the cat"]})
    assert rerank.status_code == 400 and rerank.json()["error"]["param"] == "model"
    long = post("/v1/embeddings", {"input": "the cat " * 40})
    assert long.status_code == 400 and long.json()["error"]["param"] == "input[0]"
    models = httpx.get(f"{bert_server.base_url}/v1/models", headers=bert_server.headers(),
                       timeout=10).json()
    assert models["data"][0]["id"] == NAME


def test_task_generate_stops_the_start(bert):
    path, _, _ = bert
    done = subprocess.run([sys.executable, "-m", "server", "--model", str(path),
                           "--task", "generate", "--port", "0"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--task embed" in done.stderr and "no LM head" in done.stderr


def test_task_setting_from_flag_and_environment():
    from server.cli import parse_settings
    from server.settings import SettingsError

    assert parse_settings(["--task", "embed"], environ={}).task == "embed"
    assert parse_settings([], environ={"KVSERVE_TASK": "generate"}).task == "generate"
    assert parse_settings([], environ={}).task is None
    with pytest.raises(SettingsError, match="task"):
        parse_settings(["--task", "summarize"], environ={})
