"""POST /v1/embeddings on the default model (server/embeddings/serving_embeddings.py) through the
openai SDK: last-token vectors equal to transformers' on the same GGUF weights,
normalised, of the hidden size, in input order; base64 equal to float; token-id
inputs equal to text; `dimensions` truncated and renormalised; limits named; a chat
streaming beside embeddings keeps its answer."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch

from tests.server.conftest import API_KEY

MODEL = "smollm2-135m-instruct"
TEXTS = ["The cat sat on the mat.", "Paged attention keeps KV blocks.", "hello",
         "The cat sat on the mat."]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.openai_base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loading.model_files import resolve_embedded

    path = resolve_embedded(MODEL)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def test_vectors_match_transformers_last_token_pooling(sdk, reference):
    model, tokenizer = reference
    data = sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float").data
    assert [item.index for item in data] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, data):
        got = torch.tensor(item.embedding, dtype=torch.float64)
        assert got.shape == (model.config.hidden_size,)
        assert abs(got.norm().item() - 1.0) < 1e-5
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            want = model.model(ids).last_hidden_state[0, -1].double()
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.999
    assert data[0].embedding == data[3].embedding


def test_encodings_token_inputs_and_dimensions(server, sdk, reference):
    _, tokenizer = reference
    floats = sdk.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float").data
    raw = httpx.post(f"{server.base_url}/v1/embeddings", timeout=60,
                     headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"model": MODEL, "input": TEXTS[:2], "encoding_format": "base64"})
    for item, packed in zip(floats, raw.json()["data"]):
        decoded = struct.unpack(f"<{len(item.embedding)}f", base64.b64decode(packed["embedding"]))
        assert list(decoded) == pytest.approx(item.embedding, abs=1e-7)
    ids = [tokenizer(text).input_ids for text in TEXTS[:2]]
    by_ids = sdk.embeddings.create(model=MODEL, input=ids, encoding_format="float").data
    assert [d.embedding for d in by_ids] == [d.embedding for d in floats]
    cut = sdk.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64,
                                encoding_format="float").data[0].embedding
    head = torch.tensor(floats[0].embedding[:64])
    assert len(cut) == 64 and torch.allclose(torch.tensor(cut), head / head.norm(), atol=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "word " * 9000}, "input[0]"),
    ({"input": [[1, 2, 10 ** 9]]}, "input[0]"),
    ({"input": "hi", "dimensions": 10_000}, "dimensions"),
])
def test_limits_are_named(server, body, param):
    reply = httpx.post(f"{server.base_url}/v1/embeddings", timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_chat_beside_embeddings_keeps_its_answer(server, sdk):
    chat = openai.OpenAI(base_url=server.openai_base_url, api_key=API_KEY, max_retries=0)
    ask = {"model": MODEL, "max_tokens": 24, "temperature": 0,
           "messages": [{"role": "user", "content": "Name three colors."}]}
    alone = chat.chat.completions.create(**ask).choices[0].message.content
    stream = chat.chat.completions.create(**ask, stream=True)
    vectors = sdk.embeddings.create(model=MODEL, input=TEXTS * 16, encoding_format="float")
    beside = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert beside == alone and len(vectors.data) == 64


def test_bench_embed_load_runs_both_phases(server):
    from bench.embed_load import main

    report = main(["--base-url", server.base_url, "--api-key", API_KEY, "--streams", "2",
                   "--output-len", "24", "--inputs", "16", "--batch", "8", "--delay", "0.2"])
    assert [p["kind"] for p in report["phases"]] == ["embeddings", "completions"]
    assert all(p["batch_errors"] == 0 and p["stream_errors"] == 0 and p["itl_ms"]["p50"]
               for p in report["phases"])
