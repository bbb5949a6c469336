"""whisper (optional): Whisper's greedy tokens against transformers', then the served
whisper-large-v3 shape's audio seconds per wall second."""

from __future__ import annotations

import argparse

from benchmarks.gpu_engine import harness
from benchmarks.gpu_engine.correctness import compare_tokens

# The whisper step's smoke model: whisper-tiny's vocabulary and special tokens (so its
# generation config's suppressed ids are real ones) at a size the CPU decodes in seconds.
SMOKE_WHISPER = dict(
    d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
    max_source_positions=150, max_target_positions=64,
)  # fmt: skip
# (concurrency, requests) of the served whisper-large-v3 shape, one 30 s window of audio each,
# which decodes to the decoder's last position (random weights): 447 tokens.
WHISPER_RUNS = ((1, 4), (16, 32), (64, 128))
SMOKE_WHISPER_RUNS = ((1, 2), (2, 4))


def step_whisper(args: argparse.Namespace, rec: harness.Recorder, sizes: harness.Sizes) -> None:
    """Whisper on the device. The whisper-tiny shape with peaked random weights saved
    by transformers: fp32 greedy tokens of 4 synthetic audio windows decoded together by the
    engine (Triton's kernels, the generation config's suppressed tokens) equal transformers'
    `generate` on the same device. Then the whisper-large-v3 shape with random weights, bf16,
    served: audio seconds per wall second through /v1/audio/transcriptions at concurrency 1, 16
    and 64 (benchmarks/transcriptions.py)."""
    import torch
    import transformers

    from benchmarks.transcriptions import serve_and_measure, synthetic_wav
    from pagedserve.engine.engine_config import EngineConfig
    from pagedserve.engine.frontend.audio import decode_audio, windows
    from pagedserve.engine.frontend.inputs import AudioPrompt
    from pagedserve.engine.frontend.llm_engine import LLMEngine
    from pagedserve.engine.models.whisper_config import WHISPER_SHAPES, WhisperConfig
    from pagedserve.engine.models.whisper_features import log_mel
    from pagedserve.scheduler import SamplingParams

    shape = {**WHISPER_SHAPES["whisper-tiny"], **(SMOKE_WHISPER if args.smoke else {})}
    c = WhisperConfig(**shape)
    folder = args.scratch / "whisper-tiny"
    with rec.part(model="whisper-tiny", check="fp32_greedy"):
        torch.manual_seed(0)
        hf_config = transformers.WhisperConfig(
            **shape, bos_token_id=c.eos_token_id, pad_token_id=c.eos_token_id, init_std=0.2
        )
        hf = transformers.WhisperForConditionalGeneration(hf_config).eval()
        hf.save_pretrained(folder)
        audio = [windows(decode_audio(synthetic_wav(c.window_seconds, seed)), c.window_seconds)[0]
                 for seed in range(4)]  # fmt: skip
        features = log_mel(audio, c.num_mel_bins, c.num_frames)
        max_new = sizes.correctness_tokens
        with torch.inference_mode():
            hf = hf.to(sizes.device)
            out = hf.generate(features.to(sizes.device), max_new_tokens=max_new).tolist()
        expected = [row[: row.index(c.eos_token_id) + 1] if c.eos_token_id in row else row
                    for row in out]  # fmt: skip
        del hf
        harness.free_memory()
        config = EngineConfig(model=str(folder), device=sizes.device, dtype="float32")
        engine = LLMEngine(config)
        params = SamplingParams(temperature=0.0, max_tokens=max_new)
        for i, samples in enumerate(audio):
            engine.add_request(f"r{i}", AudioPrompt([c.decoder_start_token_id], samples), params)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step())
        rec.write({
            "model": "whisper-tiny", "check": "fp32_greedy",
            "engine": engine.core.worker.attention_backend,
            **compare_tokens(expected, [list(outputs[f"r{i}"]) for i in range(len(audio))]),
            "num_tokens": max_new,
            "blocks_free_after": engine.core.scheduler.kv_cache_manager.num_used_blocks == 0,
        })  # fmt: skip
        del engine
        harness.free_memory()

    model, label = (str(folder), "whisper-tiny-smoke") if args.smoke else ("whisper-large-v3",) * 2
    serve_args = ["--device", sizes.device, "--dtype", sizes.dtype,
                  "--max-num-batched-tokens", "16384"]  # fmt: skip
    runs = SMOKE_WHISPER_RUNS if args.smoke else WHISPER_RUNS
    with rec.part(model=label, kind="transcription"):
        for record in serve_and_measure(model, serve_args, list(runs), c.window_seconds,
                                        args.out / "whisper_server.log"):  # fmt: skip
            rec.write({"kind": "transcription", **record, "model": label})
