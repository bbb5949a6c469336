"""Audio in, for Whisper: an uploaded file's bytes -> mono float32 samples at 16 kHz ->
30-second windows, one request each (their log-mel features are made where the encoder runs:
engine/models/whisper_features.py).

Decoding is soundfile's (libsndfile: WAV, FLAC, MP3, OGG Vorbis/Opus and more), resampling
soxr's, so each is the field's own code.
"""

from __future__ import annotations

import io

import numpy as np

from pagedserve.engine.models.whisper_config import SAMPLE_RATE

WINDOW_SECONDS = 30  # one encoder pass: max_source_positions (1500) x 2 frames x 10 ms
READABLE = "WAV, FLAC, MP3 or OGG"


def decode_audio(data: bytes) -> np.ndarray:
    """The samples of an audio file's bytes, mixed down to mono and resampled to SAMPLE_RATE:
    float32 [samples]. ValueError (saying which formats are read) for bytes that are not audio,
    and for a file without samples."""
    import soundfile
    import soxr

    if not data:
        raise ValueError(f"the audio file is empty; send a {READABLE} file")
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as exc:
        # libsndfile's own words, without the repr of the buffer it was reading.
        detail = getattr(exc, "error_string", None) or str(exc)
        raise ValueError(
            f"could not decode the audio file ({detail}); send a {READABLE} file"
        ) from exc
    if samples.shape[0] == 0:
        raise ValueError("the audio file holds no samples")
    mono = samples.mean(axis=1, dtype=np.float32)
    if rate != SAMPLE_RATE:
        mono = soxr.resample(mono, rate, SAMPLE_RATE).astype(np.float32, copy=False)
    return np.ascontiguousarray(mono)


def windows(samples: np.ndarray, seconds: float = WINDOW_SECONDS) -> list[np.ndarray]:
    """Consecutive windows of `seconds` (the last one shorter), each transcribed on its own as
    Whisper's sequential long-form decoding does without timestamps."""
    step = round(seconds * SAMPLE_RATE)
    return [samples[start : start + step] for start in range(0, max(len(samples), 1), step)]


def duration(samples: np.ndarray) -> float:
    return len(samples) / SAMPLE_RATE
