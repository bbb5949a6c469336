"""Transcription throughput through `POST /v1/audio/transcriptions`: seconds of audio
transcribed per wall second at each concurrency, with request latency, for a Whisper model
served by `pagedserve serve`:

    python -m benchmarks.transcriptions --model whisper-tiny --concurrency 1 16
    python -m benchmarks.transcriptions --model DIR --serve-args="--dtype float32" \
        --out FILE.json
    python -m benchmarks.transcriptions --base-url http://127.0.0.1:8000 --model NAME
        (a server already up)

Each request uploads its own synthetic WAV of --audio-seconds (a gliding tone under noise) and
asks for verbose_json, whose segments carry the tokens decoded, so the output tokens are counted
exactly. A built-in shape (engine/models/whisper_config.py WHISPER_SHAPES) has random weights:
its windows decode to the decoder's last position, as no end of text comes; that is the most
work a window can be. Every concurrency first sends one untimed request.
"""

from __future__ import annotations

import argparse
import io
import json
import shlex
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pagedserve.engine.frontend.audio import SAMPLE_RATE
from pagedserve.server.launch import server_process


def synthetic_wav(seconds: float, seed: int) -> bytes:
    """A mono 16 kHz WAV: a tone gliding from 200 Hz up by a seed-dependent amount, under noise."""
    import soundfile

    gen = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    glide = 200.0 + (50.0 + 10.0 * (seed % 30)) * t / max(seconds, 1e-9)
    samples = 0.3 * np.sin(2 * np.pi * np.cumsum(glide) / SAMPLE_RATE)
    samples += 0.05 * gen.standard_normal(len(t))
    buf = io.BytesIO()
    soundfile.write(buf, samples.astype(np.float32), SAMPLE_RATE, format="WAV")
    return buf.getvalue()


def _transcribe(http: httpx.Client, model: str, wav: bytes) -> tuple[float, int]:
    """(seconds the request took, tokens decoded)."""
    start = time.perf_counter()
    r = http.post(
        "/v1/audio/transcriptions",
        files={"file": ("audio.wav", wav, "audio/wav")},
        data={"model": model, "response_format": "verbose_json"},
    )
    r.raise_for_status()
    tokens = sum(len(s["tokens"]) for s in r.json()["segments"])
    return time.perf_counter() - start, tokens


def measure(
    base_url: str, model: str, concurrency: int, num_requests: int, audio_seconds: float
) -> dict[str, Any]:
    """Send `num_requests` transcriptions, `concurrency` at a time (after one untimed)."""
    wavs = [synthetic_wav(audio_seconds, seed) for seed in range(num_requests)]
    local = [httpx.Client(base_url=base_url, timeout=3600) for _ in range(concurrency)]
    try:
        _transcribe(local[0], model, synthetic_wav(audio_seconds, seed=10_000))
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            done = list(
                pool.map(
                    lambda i: _transcribe(local[i % concurrency], model, wavs[i]),
                    range(num_requests),
                )  # fmt: skip
            )
        wall = time.perf_counter() - start
    finally:
        for http in local:
            http.close()
    latencies = sorted(d[0] for d in done)
    tokens = sum(d[1] for d in done)
    audio = audio_seconds * num_requests
    return {
        "model": model,
        "concurrency": concurrency,
        "requests": num_requests,
        "audio_seconds_each": audio_seconds,
        "wall_s": round(wall, 3),
        "audio_s_per_s": round(audio / wall, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 1),
        "latency_p50_s": round(statistics.median(latencies), 3),
        "latency_max_s": round(latencies[-1], 3),
    }


def serve_and_measure(
    model: str,
    serve_args: list[str],
    runs: list[tuple[int, int]],
    audio_seconds: float,
    log_path: Path,
) -> list[dict[str, Any]]:
    """Start `pagedserve serve --model MODEL SERVE_ARGS`, measure each (concurrency, number of
    requests) of `runs`, stop it."""
    args = ["--model", model, "--served-model-name", "whisper", "--no-access-log", *serve_args]
    with server_process(args, log_path, timeout=600) as base:
        records = [measure(base, "whisper", c, n, audio_seconds) for c, n in runs]
    return [{**r, "model": model, "serve_args": " ".join(serve_args)} for r in records]


def transformers_baseline(
    shape: str, dtype: str, concurrency: int, num_requests: int, audio_seconds: float
) -> dict[str, Any]:
    """transformers' `generate` on the same audio, features made the same way, in batches of
    `concurrency`, without HTTP: a built-in shape with transformers' own random weights, each
    window decoding as far as the decoder's positions allow (an end of text ends a row early,
    and the tokens are counted as generated)."""
    import torch
    import transformers

    from pagedserve.engine.engine_config import DTYPES
    from pagedserve.engine.frontend.audio import decode_audio, log_mel, windows
    from pagedserve.engine.models.whisper_config import WHISPER_SHAPES, WhisperConfig

    c = WhisperConfig(**WHISPER_SHAPES[shape])
    hf_config = transformers.WhisperConfig(
        **WHISPER_SHAPES[shape], bos_token_id=c.eos_token_id, pad_token_id=c.eos_token_id
    )
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(hf_config).eval().to(DTYPES[dtype])
    features = torch.cat([
        log_mel(windows(decode_audio(synthetic_wav(audio_seconds, seed)), c.window_seconds),
                c.num_mel_bins, c.num_frames)
        for seed in range(num_requests)
    ]).to(DTYPES[dtype])  # fmt: skip
    max_new = c.max_target_positions - 1
    with torch.inference_mode():
        model.generate(features[:1], max_new_tokens=4)  # warm-up
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(features), concurrency):
            out = model.generate(features[i : i + concurrency], max_new_tokens=max_new)
            tokens += int((out != c.eos_token_id).sum()) + int((out == c.eos_token_id).any(1).sum())
        wall = time.perf_counter() - start
    return {
        "model": f"{shape} (transformers generate)",
        "concurrency": concurrency,
        "requests": num_requests,
        "audio_seconds_each": audio_seconds,
        "wall_s": round(wall, 3),
        "audio_s_per_s": round(audio_seconds * num_requests / wall, 2),
        "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.transcriptions", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--model", default="whisper-tiny", help="Whisper folder or built-in shape")
    p.add_argument("--serve-args", default="", help="more `pagedserve serve` flags, one string")
    p.add_argument("--base-url", default=None, help="measure a server already running there")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--num-requests", type=int, default=32, help="per concurrency")
    p.add_argument("--audio-seconds", type=float, default=30.0, help="of each request's audio")
    p.add_argument("--out", type=Path, default=None, help="write the records here (JSON)")
    p.add_argument(
        "--transformers",
        default=None,
        metavar="DTYPE",
        help="then transformers' generate on the same audio in this dtype, batches of each "
        "concurrency (built-in shapes only)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.base_url is not None:
        records = [measure(args.base_url, args.model, c, args.num_requests, args.audio_seconds)
                   for c in args.concurrency]  # fmt: skip
    else:
        log = (args.out or Path("transcriptions")).with_suffix(".server.log")
        runs = [(c, args.num_requests) for c in args.concurrency]
        records = serve_and_measure(args.model, shlex.split(args.serve_args), runs,
                                    args.audio_seconds, log)  # fmt: skip
    if args.transformers is not None:
        records += [
            transformers_baseline(args.model, args.transformers, c, args.num_requests,
                                  args.audio_seconds)
            for c in args.concurrency
        ]  # fmt: skip
    for r in records:
        print(json.dumps(r))
    if args.out is not None:
        args.out.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
