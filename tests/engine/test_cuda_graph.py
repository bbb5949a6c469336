"""Decode steps through the CUDA-graph buffers, and the start-up memory profile.

CI has no GPU, so nothing here captures a graph: `DecodeGraphs(capture=False)` runs every decode
step through the same persistent buffers and padding as a replay would and runs the model eagerly
on them. That checks what a replay computes (padding rows, stale buffer contents, batch buckets);
the capture itself runs on the H200 in `benchmarks/gpu_engine/` (its decode step).
"""

from __future__ import annotations

import random

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.worker.cuda_graph import DecodeGraphs, capture_batch_sizes
from pagedserve.engine.worker.kv_cache import GiB, gpu_kv_cache_budget
from pagedserve.engine.worker.model_runner import ModelRunner, profile_step
from pagedserve.kernels import triton_attention
from pagedserve.scheduler.utils import cdiv
from tests.helpers import hf_greedy

PROMPT_LENGTHS = [1, 5, 12, 23, 40]


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 32] and sizes[-2:] == [240, 256] and len(sizes) == 20
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        capture_batch_sizes(0)


def _with_buffers(llm: LLM, max_batch_size: int) -> tuple[DecodeGraphs, list[int]]:
    """Route the engine's decode steps through DecodeGraphs(capture=False); record batch sizes."""
    engine = llm.engine
    graphs = DecodeGraphs(
        engine.core.worker.model,
        engine.core.worker.runner.kv_caches,
        max_batch_size,
        cdiv(engine.max_model_len, engine.core.config.cache.block_size),
        engine.core.worker.device,
        capture=False,
    )
    sizes: list[int] = []
    real_run = graphs.run

    def run(input_ids, positions, meta):
        sizes.append(input_ids.shape[0])
        return real_run(input_ids, positions, meta)

    graphs.run = run
    engine.core.worker.runner.graphs = graphs
    return graphs, sizes


@pytest.mark.parametrize(
    "backend",
    [
        "torch",
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                not triton_attention.INTERPRETED,
                reason="CPU tensors need Triton's interpreter (set by tests/conftest.py only "
                "without a GPU)",
            ),
        ),
    ],
)
def test_padded_decode_buffers_give_transformers_greedy_tokens(backend, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32").eval()
    expected = [hf_greedy(hf, p, 10) for p in prompts]

    llm = LLM(
        str(tiny_llama_dir),
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_model_len=128,
        attention_backend=backend,
    )
    # Largest "graph" 4: the 5-sequence decode steps run eagerly, the 3-sequence ones (after the
    # two shortest finish) in the padded size-4 buffers.
    graphs, sizes = _with_buffers(llm, max_batch_size=4)
    max_tokens = [10, 10, 10, 6, 6]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [e[:m] for e, m in zip(expected, max_tokens, strict=True)]
    assert sizes == [3] * 4  # steps 7..10 of the three longer-running sequences
    assert graphs.padded_size(3) == 4
    # Padding rows wrote nothing: slot -1, length 1.
    assert graphs.slot_mapping[0, 3].item() == -1 and graphs.seq_lens[3].item() == 1

    # Stale rows from that run (longer block tables, other ids) do not leak into the next one.
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params[:2])]
    assert again == [e[:10] for e in expected[:2]]
    # Ten steps of one token per sequence: the prefix cache holds the 5-token prompt's first
    # block, so even the first step (its fifth token, the other prompt's only token) fits.
    assert sizes[4:] == [2] * 10


def test_decode_graphs_refuse_capture_without_cuda(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=32)
    engine = llm.engine
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, got cpu"):
        DecodeGraphs(
            engine.core.worker.model,
            engine.core.worker.runner.kv_caches,
            8,
            16,
            engine.core.worker.device,
        )
    graphs = DecodeGraphs(
        engine.core.worker.model,
        engine.core.worker.runner.kv_caches,
        8,
        16,
        engine.core.worker.device,
        capture=False,
    )
    assert graphs.can_run(num_tokens=8, num_seqs=8, block_table_width=16)
    assert not graphs.can_run(num_tokens=9, num_seqs=8, block_table_width=16)  # a prefill
    assert not graphs.can_run(num_tokens=9, num_seqs=9, block_table_width=16)  # too many
    assert not graphs.can_run(num_tokens=2, num_seqs=2, block_table_width=17)  # too long
    with pytest.raises(ValueError, match="9 sequences exceed the largest graph"):
        graphs.padded_size(9)


def test_profile_step_is_the_largest_step():
    step = profile_step(10, max_num_seqs=4, block_size=4, max_model_len=64, vocab_size=300)
    assert [len(s.token_ids) for s in step.new_requests] == [3, 3, 2, 2]
    assert [s.block_ids for s in step.new_requests] == [(0,), (1,), (2,), (3,)]
    # Every sequence is scheduled whole from position 0, so each samples.
    assert list(step.num_scheduled_tokens.values()) == [3, 3, 2, 2]
    assert all(
        s.num_computed_tokens == 0 and s.num_prompt_tokens == len(s.token_ids)
        for s in step.new_requests
    )
    assert step.total_num_scheduled_tokens == 10
    # One sequence may not exceed max_model_len - 1 tokens: more sequences then.
    step = profile_step(5000, max_num_seqs=1, block_size=16, max_model_len=2049, vocab_size=50)
    assert [len(s.token_ids) for s in step.new_requests] == [1667, 1667, 1666]
    assert step.new_requests[1].block_ids == tuple(range(105, 210))
    assert max(t for s in step.new_requests for t in s.token_ids) == 49


def test_profile_step_runs_and_samples_every_sequence(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    step = profile_step(48, 6, 16, engine.max_model_len, engine.core.model_config.vocab_size)
    runner = ModelRunner(
        engine.core.worker.model,
        engine.core.worker.runner.kv_caches,
        16,
        engine.core.worker.device,
        6,
        engine.max_model_len,
    )
    out = runner.execute(step)
    assert sorted(out.sampled_token_ids) == sorted(f"profile-{i}" for i in range(6))
    assert all(0 <= t < engine.core.model_config.vocab_size for t in out.sampled_token_ids.values())


def test_gpu_kv_cache_budget():
    total = 140 * GiB
    assert gpu_kv_cache_budget(total, 0.9, 5 * GiB, 2 * GiB) == int(126 * GiB) - 7 * GiB
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        gpu_kv_cache_budget(total, 0.05, 5 * GiB, 2 * GiB)


def test_engine_on_cpu_has_no_graphs(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=32)
    assert llm.engine.core.worker.runner.graphs is None
