"""LLMEngine behaviour on a tiny random Llama: aborts, n samples, stop tokens, limits, errors."""

from __future__ import annotations

import pytest

from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams
from tests.helpers import finish_all


def _engine(tiny_llama_dir, **changes) -> LLMEngine:
    fields = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), **{**fields, **changes}))


@pytest.fixture
def engine(tiny_llama_dir) -> LLMEngine:
    return _engine(tiny_llama_dir)


def test_abort_frees_blocks_in_every_state(engine):
    kv = engine.core.scheduler.kv_cache_manager
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", list(range(3, 13)), params)  # 10 tokens: 3 blocks once admitted
    engine.add_request("b", list(range(20, 26)), params)
    engine.step()
    engine.step()
    used_with_both = kv.num_used_blocks
    # a: 10 prompt + 2 outputs -> 3 blocks (the 12th token's slot is reserved next step);
    # b: 6 + 2 -> 2 blocks.
    assert used_with_both == 5
    aborted = engine.abort("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) == 2
    assert kv.num_used_blocks == 2
    engine.add_request("c", list(range(30, 40)), params)  # waiting: never scheduled
    assert engine.abort("c").outputs[0].token_ids == []
    assert engine.abort("missing") is None
    done = finish_all(engine)
    assert list(done) == ["b"]
    assert len(done["b"].outputs[0].token_ids) == 20
    assert kv.num_used_blocks == 0


def test_n_samples_share_the_prompt(engine):
    engine.add_request("g", [5, 6, 7, 8, 9], SamplingParams(temperature=0, n=3, max_tokens=6))
    out = finish_all(engine)["g"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    tokens = [c.token_ids for c in out.outputs]
    assert tokens[0] == tokens[1] == tokens[2]  # greedy: identical samples
    assert len(tokens[0]) == 6 and {c.finish_reason for c in out.outputs} == {"length"}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shared_samples_equal_separate_requests(tiny_llama_dir, backend):
    """n = 4 seeded samples of a prompt whose last shared block is partial: the samples fork the
    first one's blocks and copy that block on their first write (on the runner: one copy_blocks
    call). Each sample equals a request of its own with its seed, which computes the prompt
    alone: tokens exactly, logprobs to float rounding."""
    engine = _engine(tiny_llama_dir, attention_backend=backend)
    kv = engine.core.scheduler.kv_cache_manager
    prompt = list(range(30, 40))  # the samples share 9 tokens: 2 whole blocks and 1 of 4
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=6, logprobs=1)
    engine.add_request("group", prompt, params)
    engine.step()  # sample 0's prompt; with its token back, the others fork its blocks
    assert kv.num_used_blocks == 3 and kv.ref_counts("1:group") == [4, 4, 4]
    shared = finish_all(engine)["group"]
    assert kv.num_block_copies == 3 and kv.num_used_blocks == 0
    for k in range(4):
        engine.add_request(f"alone{k}", prompt, params.clone(n=1, seed=11 + k))
    alone = finish_all(engine)
    assert kv.num_block_copies == 3  # separate requests share only through the prefix cache
    tokens = [c.token_ids for c in shared.outputs]
    assert tokens == [alone[f"alone{k}"].outputs[0].token_ids for k in range(4)]
    assert len({tuple(t) for t in tokens}) == 4  # the samples differ: a missed copy would show
    for k, sample in enumerate(shared.outputs):
        ref = alone[f"alone{k}"].outputs[0]
        assert sample.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-4)


def test_stop_token_id_ends_the_sample(engine):
    prompt = [11, 12, 13, 14]
    engine.add_request(
        "free", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    free = finish_all(engine)["free"].outputs[0].token_ids
    stop = free[4]
    engine.add_request(
        "stopped",
        prompt,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop]),
    )
    out = finish_all(engine)["stopped"].outputs[0]
    first = free.index(stop)
    assert out.token_ids == free[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_max_model_len_ends_with_length(engine):
    prompt = list(range(3, 3 + 120))
    engine.add_request(
        "long", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    )
    out = finish_all(engine)["long"].outputs[0]
    assert len(out.token_ids) == 128 - 120 and out.finish_reason == "length"


def test_bad_requests_are_refused_and_nothing_is_queued(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="prompt has 128 tokens but max_model_len is 128"):
        engine.add_request("l", list(range(3, 131)), SamplingParams())
    with pytest.raises(
        ValueError, match=r"prompt token id -1 is outside the vocabulary \[0, 512\)"
    ):
        engine.add_request("v", [5, -1], SamplingParams())
    # The tiny checkpoint has no tokenizer files: text goes through the synthetic tokenizer.
    assert engine.tokenize("<300><301>") == [300, 301]
    with pytest.raises(ValueError, match="must be a SamplingParams"):
        engine.add_request("p", [5], {"temperature": 0})
    engine.add_request("ok", [5], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [5], SamplingParams())
    assert engine.num_unfinished_requests == 1
    assert engine.core.scheduler.num_waiting == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "int8"}, "dtype must be"),
        ({"device": "tpu"}, "device must be"),
        ({"load_format": "pickle"}, "load_format must be"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"max_num_seqs": -3}, "max_num_seqs must be a positive integer"),
        ({"max_num_seqs": None}, "max_num_seqs must be an integer, got None"),
        ({"block_size": True}, "block_size must be an integer, got True"),
        ({"max_model_len": 2.0}, "max_model_len must be an integer, got 2.0"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be a bool, got 'yes'"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"model": None}, "model must be a string, got None"),
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.01}, "the share of GPU memory to use, got 1.01"),
        ({"gpu_memory_utilization": True}, "gpu_memory_utilization must be a number, got True"),
        ({"max_cuda_graph_batch_size": 0}, "max_cuda_graph_batch_size must be a positive"),
    ],
)
def test_engine_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_max_model_len_beyond_the_model_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="exceeds the model's context length 512"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", max_model_len=4096))


def test_kv_cache_too_small_for_one_sequence(tiny_llama_dir):
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=128"):
        LLMEngine(
            EngineConfig(
                model=str(tiny_llama_dir),
                device="cpu",
                block_size=4,
                num_kv_blocks=8,
                max_model_len=128,
            )
        )


def test_output_kinds_describe_the_same_generation(engine):
    """One request three ways: cumulative snapshots every step, deltas (only what is new, folded
    back with RequestOutput.add) and the final output alone."""
    params = SamplingParams(
        temperature=0, max_tokens=12, n=2, logprobs=1, stop=["<0x"], ignore_eos=True
    )
    prompt = [5, 6, 7, 8, 9, 10]
    outputs: dict[str, list] = {kind: [] for kind in ("cumulative", "delta", "final")}
    for kind in outputs:
        engine.add_request(kind, prompt, params.clone(output_kind=kind))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)

    (final,) = outputs["final"]
    assert final.finished
    cumulative = outputs["cumulative"]
    assert len(cumulative) > 1 and cumulative[-1].finished
    deltas = outputs["delta"]
    assert len(deltas) == len(cumulative)
    # A delta carries each token once; the finish arrives with the sample's last delta.
    for index in (0, 1):
        pieces = [c for d in deltas for c in d.outputs if c.index == index]
        assert sum(len(c.token_ids) for c in pieces) == len(cumulative[-1].outputs[index].token_ids)
        assert [c.finish_reason for c in pieces][:-1] == [None] * (len(pieces) - 1)
        assert all(len(c.logprobs) == len(c.token_ids) for c in pieces)
    whole = deltas[0]  # folding changes it in place: read the deltas before
    for delta in deltas[1:]:
        whole.add(delta)
    for out in (whole, final):
        for c, ref in zip(out.outputs, cumulative[-1].outputs, strict=True):
            assert (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) == (
                ref.index,
                ref.token_ids,
                ref.text,
                ref.finish_reason,
                ref.stop_reason,
            )
            assert [list(e) for e in c.logprobs] == [list(e) for e in ref.logprobs]
            assert c.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_rewind_continues_like_a_fresh_request_with_the_kept_tokens(
    tiny_llama_dir, async_scheduling
):
    engine = _engine(tiny_llama_dir, async_scheduling=async_scheduling)
    kv = engine.core.scheduler.kv_cache_manager
    prompt = list(range(40, 47))
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, logprobs=0)
    engine.add_request("r", prompt, params)
    out = None
    while out is None or len(out.outputs[0].token_ids) < 20:
        outputs = engine.step()  # (nothing from the first, with a step in flight)
        out = outputs[-1] if outputs else out
    first = list(out.outputs[0].token_ids)
    assert len(first) == 20
    # 7 + 20 tokens, 26 computed (27 with a step in flight): 7 blocks.
    assert kv.num_used_blocks == 7
    (rewound,) = engine.rewind("r", 8)
    sample = rewound.outputs[0]
    assert sample.token_ids == first[:12] and len(sample.logprobs) == 12
    assert sample.text == engine.tokenizer.decode(first[:12])
    taken_back = zip(first[12:], out.outputs[0].logprobs[12:], strict=True)
    dropped = sum(entry[token].logprob for token, entry in taken_back)
    assert sample.cumulative_logprob == pytest.approx(out.outputs[0].cumulative_logprob - dropped)
    # 19 tokens left, 18 of them kept in the cache (the 19th is computed again): 5 blocks.
    assert kv.num_used_blocks == 5
    steps_before = engine.core.num_steps
    done = finish_all(engine)["r"].outputs[0]
    # One step per token (the kept 18 were not computed again); greedy: the same tokens again.
    assert engine.core.num_steps - steps_before == 16 + async_scheduling
    assert done.token_ids == first + _continue(engine, prompt + first, 8)
    # A fresh request of the kept tokens continues the same way.
    assert done.token_ids[12:] == _continue(engine, prompt + first[:12], 16)
    assert kv.num_used_blocks == 0

    with pytest.raises(ValueError, match="request 'r' is unknown or finished"):
        engine.rewind("r", 1)
    engine.add_request("s", prompt, params.clone(max_tokens=3))
    engine.step()
    engine.step()
    have = 2 - async_scheduling  # (a token in flight is not the sample's yet)
    with pytest.raises(ValueError, match=f"cannot rewind by 3 tokens: sample '0:s' has {have} "):
        engine.rewind("s", 3)


def _continue(engine: LLMEngine, prompt: list[int], num_tokens: int) -> list[int]:
    engine.add_request(
        "fresh", prompt, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    )
    return finish_all(engine)["fresh"].outputs[0].token_ids


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(engine):
    prompt = list(range(50, 58))
    params = SamplingParams(temperature=1.0, seed=21, n=2, best_of=5, max_tokens=6)
    engine.add_request("best", prompt, params)
    # The same 5 samples (sample k draws with seed + k), all returned, with their logprobs.
    engine.add_request("all", prompt, params.clone(n=5, best_of=None, logprobs=0))
    done = finish_all(engine)
    every = sorted(done["all"].outputs, key=lambda c: -c.cumulative_logprob)
    assert len({tuple(c.token_ids) for c in every}) == 5
    best = done["best"].outputs
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in every[:2]]
    assert [c.cumulative_logprob for c in best] == pytest.approx(
        [c.cumulative_logprob for c in every[:2]]
    )
    assert all(c.logprobs is None for c in best)  # computed for the ranking, not asked for
    assert engine.core.scheduler.kv_cache_manager.num_used_blocks == 0
