"""POST /v1/rerank and /v1/score (server/embeddings/serving_rerank.py) on a tiny random
Qwen2ForSequenceClassification served from its saved checkpoint: each pair's score
equals transformers' `model(**tokenizer(query, document)).logits`, the results come
best first; `top_n`, `return_documents: false`, the aliases, the limits, and a model
without a classification head (400 naming why)."""

from __future__ import annotations

import httpx
import pytest
import torch

from server.protocol.rerank import MAX_RERANK_DOCUMENTS
from tests.server.conftest import API_KEY, launch_server

NAME = "tiny-reranker"
QUERY = "How does paged attention store keys?"
DOCUMENTS = ["Paged attention keeps the KV cache in fixed-size blocks.",
             "The cat sat on the mat.", "hello", "Blocks of keys and values, paged.",
             "Rerankers score a query against each document."]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, tokenizer):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, num_labels=1, pad_token_id=None,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    reference = Qwen2ForSequenceClassification(config).eval()
    with torch.no_grad():     # a random head's scores sit near 0: spread them out
        reference.score.weight.mul_(20)
    path = tmp_path_factory.mktemp("reranker")
    reference.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, reference


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory, reranker):
    path, _ = reranker
    yield from launch_server(tmp_path_factory, [
        "--model", str(path), "--served-model-name", NAME, "--api-key", API_KEY,
        "--page-size", "16", "--num-blocks", "64", "--max-batch-tokens", "32"])


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{route}", headers=server.headers(), timeout=60,
                      json={"model": NAME, **body})


def expected_scores(reranker, tokenizer, query: str, documents: list[str]) -> list[float]:
    _, reference = reranker
    scores = []
    for document in documents:
        inputs = tokenizer(query, document, return_tensors="pt")
        with torch.no_grad():
            scores.append(reference(**inputs).logits[0, 0].item())
    return scores


def test_rerank_scores_equal_transformers_best_first(rerank_server, reranker, tokenizer):
    want = expected_scores(reranker, tokenizer, QUERY, DOCUMENTS)
    reply = post(rerank_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(len(want)), key=lambda i: -want[i])
    for result in results:
        assert result["relevance_score"] == pytest.approx(want[result["index"]], rel=1e-4,
                                                          abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    tokens = sum(len(tokenizer(QUERY, d).input_ids) for d in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert body["model"] == NAME and body["id"].startswith("rerank-")
    assert len(set(want)) == len(want) and max(want) - min(want) > 0.1   # the order means something


def test_top_n_objects_and_aliases(rerank_server):
    full = post(rerank_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    objects = [{"text": d} for d in DOCUMENTS]
    for route in ("/v1/rerank", "/rerank", "/v2/rerank"):
        reply = post(rerank_server, route, {"query": QUERY, "documents": objects, "top_n": 2,
                                            "return_documents": False})
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        assert [r["index"] for r in results] == [r["index"] for r in full["results"][:2]]
        assert all("document" not in r for r in results)


def test_score_pairs_one_against_many_and_pairwise(rerank_server, reranker, tokenizer):
    want = expected_scores(reranker, tokenizer, QUERY, DOCUMENTS[:3])
    reply = post(rerank_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[:3]})
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert [(d["index"], d["object"]) for d in data] == [(0, "score"), (1, "score"), (2, "score")]
    assert [d["score"] for d in data] == pytest.approx(want, rel=1e-4, abs=1e-5)
    pairwise = post(rerank_server, "/v1/score", {"text_1": [QUERY, "hello"],
                                                 "text_2": [DOCUMENTS[0], DOCUMENTS[1]]})
    second = expected_scores(reranker, tokenizer, "hello", [DOCUMENTS[1]])[0]
    assert [d["score"] for d in pairwise.json()["data"]] == pytest.approx(
        [want[0], second], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("route, body, param", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"] * (MAX_RERANK_DOCUMENTS + 1)},
     "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["ok", "word " * 600]}, "documents[1]"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"txt": "a"}]}, "documents[0]"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
])
def test_bad_requests_are_named(rerank_server, route, body, param):
    reply = post(rerank_server, route, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith(param), reply.json()


def test_generation_on_a_classifier_is_refused(rerank_server):
    reply = post(rerank_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 400, reply.text
    assert "embedding model (task 'embed')" in reply.json()["error"]["message"]
    assert "/v1/rerank" in reply.json()["error"]["message"]


@pytest.mark.slow
def test_a_model_without_a_head_is_refused(server):
    reply = httpx.post(f"{server.base_url}/v1/rerank", headers=server.headers(), timeout=60,
                       json={"query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "model" and "sequence-classification head" in error["message"]


def test_relevance_of_several_labels_is_the_log_odds_of_label_1():
    from server.embeddings.serving_rerank import relevance

    assert relevance([0.7]) == 0.7
    assert relevance([0.5, 2.0]) == pytest.approx(1.5)
    logits = torch.tensor([0.3, 1.2, -0.4, 2.0])
    p1 = torch.softmax(logits, 0)[1].item()
    assert relevance(logits.tolist()) == pytest.approx(torch.logit(torch.tensor(p1)).item(),
                                                       rel=1e-5)


def test_the_openai_sdk_posts_rerank_and_score(rerank_server):
    import openai

    client = openai.OpenAI(base_url=rerank_server.openai_base_url, api_key=API_KEY,
                           max_retries=0)
    ranked = client.post("/rerank", cast_to=object,
                         body={"model": NAME, "query": QUERY, "documents": DOCUMENTS[:3],
                               "top_n": 1})
    scored = client.post("/score", cast_to=object,
                         body={"model": NAME, "text_1": QUERY, "text_2": DOCUMENTS[:3]})
    best = max(scored["data"], key=lambda d: d["score"])
    assert [r["index"] for r in ranked["results"]] == [best["index"]]
    assert ranked["results"][0]["relevance_score"] == pytest.approx(best["score"], abs=1e-6)
