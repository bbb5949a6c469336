"""Audio in, for Whisper: an uploaded file's bytes -> mono float32 samples at 16 kHz ->
30-second windows -> log-mel features, the input `engine/models/whisper.py` encodes.

Decoding is soundfile's (libsndfile: WAV, FLAC, MP3, OGG Vorbis/Opus and more), resampling
soxr's, the features transformers' `WhisperFeatureExtractor`, so each is the field's own code.
"""

from __future__ import annotations

import io

import numpy as np
import torch

SAMPLE_RATE = 16_000  # Whisper's
HOP_LENGTH = 160  # samples between feature frames: one frame every 10 ms
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


def log_mel(windows: list[np.ndarray], num_mel_bins: int, num_frames: int = 3000) -> torch.Tensor:
    """Whisper's log-mel features of each window, padded to `num_frames` (3000: 30 s; the
    model's WhisperConfig.num_frames): [windows, num_mel_bins, num_frames] float32
    (transformers' WhisperFeatureExtractor: 25 ms Hann windows every 10 ms, log10, clamped to 8
    below the maximum, scaled to about [-1, 1])."""
    extractor = _extractor(num_mel_bins, num_frames)
    out = extractor(windows, sampling_rate=SAMPLE_RATE, return_tensors="pt")
    return out.input_features.float()


_EXTRACTORS: dict[tuple[int, int], object] = {}


def _extractor(num_mel_bins: int, num_frames: int):
    """One extractor per feature shape (building its filter bank takes ~50 ms)."""
    from transformers import WhisperFeatureExtractor

    key = (num_mel_bins, num_frames)
    if key not in _EXTRACTORS:
        extractor = WhisperFeatureExtractor(feature_size=num_mel_bins, hop_length=HOP_LENGTH)
        # Its window length in samples, and frames: chunk_length (whole seconds) sets both for
        # Whisper's 30 s; a model with fewer encoder positions takes a shorter window.
        extractor.n_samples = num_frames * HOP_LENGTH
        extractor.nb_max_frames = num_frames
        extractor.chunk_length = extractor.n_samples / SAMPLE_RATE
        _EXTRACTORS[key] = extractor
    return _EXTRACTORS[key]
