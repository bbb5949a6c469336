"""Audio in for Whisper (engine/frontend/audio.py): files written by soundfile in each format a
client may send decode to the samples written (mixed to mono, resampled to 16 kHz), bad bytes get an
error naming the formats, long audio splits into 30-second windows, and the features
(engine/models/whisper_features.py) are transformers' WhisperFeatureExtractor's."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
import torch

from pagedserve.engine.frontend.audio import SAMPLE_RATE, decode_audio, duration, windows
from pagedserve.engine.models.whisper_features import log_mel


def _tone(seconds: float, rate: int, hz: float = 440.0, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)
    return mono if channels == 1 else np.stack([mono, 0.5 * mono], axis=1)


def _file(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def test_wav_at_16_khz_decodes_to_its_samples():
    tone = _tone(1.0, SAMPLE_RATE)
    got = decode_audio(_file(tone, SAMPLE_RATE, "WAV", "FLOAT"))
    assert got.dtype == np.float32 and got.shape == (16000,)
    assert np.array_equal(got, tone)
    assert duration(got) == 1.0


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_lossless_stereo_at_44_1_khz_decodes_to_mono_16_khz(fmt):
    stereo = _tone(2.0, 44100, channels=2)  # the right channel at half the left's amplitude
    got = decode_audio(_file(stereo, 44100, fmt, "PCM_16"))
    assert got.shape == (32000,)
    expected = _tone(2.0, SAMPLE_RATE) * 0.75  # the mean of the two channels
    # 16-bit samples and the resampler's filter: within 1e-3 away from the edges.
    assert np.abs(got[800:-800] - expected[800:-800]).max() < 1e-3


@pytest.mark.parametrize("fmt, subtype", [("OGG", "VORBIS"), ("MP3", "MPEG_LAYER_III")])
def test_lossy_stereo_decodes_to_the_same_tone(fmt, subtype):
    got = decode_audio(_file(_tone(2.0, 44100, channels=2), 44100, fmt, subtype))
    assert abs(len(got) - 32000) <= 2000  # codec padding and delay
    # The tone survives: RMS of 0.75 x 0.5 / sqrt(2), and its frequency.
    rms = float(np.sqrt(np.mean(got[4000:28000] ** 2)))
    assert abs(rms - 0.375 / np.sqrt(2)) < 0.02
    spectrum = np.abs(np.fft.rfft(got[4000:20000]))
    assert abs(np.argmax(spectrum) * SAMPLE_RATE / 16000 - 440) <= 1


def test_what_is_not_audio_is_refused_with_the_formats_read():
    with pytest.raises(ValueError, match="could not decode the audio file .*WAV, FLAC, MP3 or OGG"):
        decode_audio(b"this is a text file, not audio")
    with pytest.raises(ValueError, match="the audio file is empty"):
        decode_audio(b"")
    with pytest.raises(ValueError, match="holds no samples"):
        decode_audio(_file(np.zeros(0, np.float32), SAMPLE_RATE, "WAV"))


def test_long_audio_splits_into_30_second_windows():
    samples = np.arange(int(65.5 * SAMPLE_RATE), dtype=np.float32)
    parts = windows(samples)
    assert [len(p) for p in parts] == [480000, 480000, 88000]
    assert np.array_equal(np.concatenate(parts), samples)
    assert [len(p) for p in windows(samples[:100])] == [100]


def test_features_are_whisper_feature_extractors():
    from transformers import WhisperFeatureExtractor

    parts = [_tone(3.0, SAMPLE_RATE), _tone(30.0, SAMPLE_RATE, hz=880.0)]
    for mel in (80, 128):
        got = log_mel(parts, mel)
        want = WhisperFeatureExtractor(feature_size=mel)(
            parts, sampling_rate=SAMPLE_RATE, return_tensors="pt"
        ).input_features
        assert got.shape == (2, mel, 3000) and got.dtype == torch.float32
        assert torch.equal(got, want)


def test_a_shorter_encoder_takes_shorter_windows():
    """A model with fewer encoder positions (the tests' tiny Whisper: 150, 3 s) gets features of
    its own length: those of WhisperFeatureExtractor(chunk_length=3)."""
    from transformers import WhisperFeatureExtractor

    parts = windows(_tone(7.0, SAMPLE_RATE), seconds=3.0)
    assert [len(p) for p in parts] == [48000, 48000, 16000]
    got = log_mel(parts, 80, num_frames=300)
    want = WhisperFeatureExtractor(feature_size=80, chunk_length=3)(
        parts, sampling_rate=SAMPLE_RATE, return_tensors="pt"
    ).input_features
    assert got.shape == (3, 80, 300)
    assert torch.equal(got, want)
    assert log_mel(parts[:1], 80).shape == (1, 80, 3000)  # each shape its own extractor
