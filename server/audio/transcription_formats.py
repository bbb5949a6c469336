"""The bodies of `/v1/audio/transcriptions` responses in each `response_format` OpenAI defines
(json, text, verbose_json, srt, vtt), from a transcription's segments: one segment per
30-second window of audio (engine/frontend/audio.py `windows`), as Whisper decodes long audio
without timestamps. The endpoint is server/audio/serving_transcriptions.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")


@dataclass(frozen=True)
class Segment:
    start: float  # seconds
    end: float
    text: str
    tokens: tuple[int, ...] = ()


def _timestamp(seconds: float, separator: str) -> str:
    """HH:MM:SS<sep>mmm (SRT's separator is a comma, WebVTT's a dot)."""
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def full_text(segments: list[Segment]) -> str:
    return "".join(s.text for s in segments).strip()


def format_transcription(
    segments: list[Segment],
    response_format: str,
    *,
    duration: float,
    language: str | None = None,
) -> tuple[str | dict[str, Any], str]:
    """(body, media type): a dict for the JSON formats, text otherwise. ValueError for a format
    OpenAI does not define."""
    if response_format not in RESPONSE_FORMATS:
        raise ValueError(
            f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {response_format!r}"
        )
    text = full_text(segments)
    if response_format == "json":
        return {"text": text}, "application/json"
    if response_format == "text":
        return text + "\n", "text/plain; charset=utf-8"
    if response_format == "verbose_json":
        return {
            "task": "transcribe",
            "language": language or "unknown",
            "duration": round(duration, 3),
            "text": text,
            "segments": [
                {"id": i, "start": s.start, "end": s.end, "text": s.text, "tokens": list(s.tokens)}
                for i, s in enumerate(segments)
            ],
        }, "application/json"
    cues = [s for s in segments if s.text.strip()]
    if response_format == "srt":
        blocks = [
            f"{i}\n{_timestamp(s.start, ',')} --> {_timestamp(s.end, ',')}\n{s.text.strip()}\n"
            for i, s in enumerate(cues, start=1)
        ]
        return "\n".join(blocks), "text/plain; charset=utf-8"
    blocks = [
        f"{_timestamp(s.start, '.')} --> {_timestamp(s.end, '.')}\n{s.text.strip()}\n" for s in cues
    ]
    return "WEBVTT\n\n" + "\n".join(blocks), "text/vtt; charset=utf-8"


def window_segments(texts: list[str], tokens: list[list[int]], duration: float,
                    window_seconds: float) -> list[Segment]:  # fmt: skip
    """One segment per window: window i spans [i x window_seconds, min((i + 1) x
    window_seconds, duration)]."""
    return [
        Segment(i * window_seconds, min((i + 1) * window_seconds, duration), text, tuple(toks))
        for i, (text, toks) in enumerate(zip(texts, tokens, strict=True))
    ]
