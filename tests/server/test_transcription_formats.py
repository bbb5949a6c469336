"""The response formats of /v1/audio/transcriptions (server/audio/transcription_formats.py): the
exact bodies of json, text, verbose_json, SRT and WebVTT for a 65.5-second transcription in three
30-second windows."""

from __future__ import annotations

import pytest

from pagedserve.server.audio.transcription_formats import format_transcription, window_segments

SEGMENTS = window_segments(
    [" Hello there.", " ", " General Kenobi!"], [[10, 11], [], [12, 13, 14]], 65.5, 30
)


def test_windows_become_segments():
    assert [(s.start, s.end, s.text, s.tokens) for s in SEGMENTS] == [
        (0, 30, " Hello there.", (10, 11)),
        (30, 60, " ", ()),
        (60, 65.5, " General Kenobi!", (12, 13, 14)),
    ]


def test_json_and_text():
    assert format_transcription(SEGMENTS, "json", duration=65.5) == (
        {"text": "Hello there.  General Kenobi!"}, "application/json",
    )  # fmt: skip
    assert format_transcription(SEGMENTS, "text", duration=65.5) == (
        "Hello there.  General Kenobi!\n", "text/plain; charset=utf-8",
    )  # fmt: skip


def test_verbose_json():
    body, media = format_transcription(SEGMENTS, "verbose_json", duration=65.5, language="en")
    assert media == "application/json"
    assert body == {
        "task": "transcribe", "language": "en", "duration": 65.5,
        "text": "Hello there.  General Kenobi!",
        "segments": [
            {"id": 0, "start": 0, "end": 30, "text": " Hello there.", "tokens": [10, 11]},
            {"id": 1, "start": 30, "end": 60, "text": " ", "tokens": []},
            {"id": 2, "start": 60, "end": 65.5, "text": " General Kenobi!", "tokens": [12, 13, 14]},
        ],
    }  # fmt: skip


def test_srt_and_vtt_skip_silent_windows():
    srt, media = format_transcription(SEGMENTS, "srt", duration=65.5)
    assert media == "text/plain; charset=utf-8"
    assert srt == (
        "1\n00:00:00,000 --> 00:00:30,000\nHello there.\n\n"
        "2\n00:01:00,000 --> 00:01:05,500\nGeneral Kenobi!\n"
    )
    vtt, media = format_transcription(SEGMENTS, "vtt", duration=65.5)
    assert media == "text/vtt; charset=utf-8"
    assert vtt == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:30.000\nHello there.\n\n"
        "00:01:00.000 --> 00:01:05.500\nGeneral Kenobi!\n"
    )


def test_an_hour_and_an_unknown_format():
    long = window_segments([" late"], [[1]], 3725.25, 3600)
    srt, _ = format_transcription(long, "srt", duration=3725.25)
    assert srt == "1\n00:00:00,000 --> 01:00:00,000\nlate\n"
    with pytest.raises(ValueError, match="response_format must be one of json, text, verbose_json"):
        format_transcription(SEGMENTS, "xml", duration=1.0)
