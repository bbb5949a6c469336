"""Whisper's input features: log-mel spectrograms of 16 kHz audio, as transformers'
`WhisperFeatureExtractor` makes them (the field's own code), made where the encoder runs."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.engine.models.whisper_config import HOP_LENGTH, SAMPLE_RATE


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
