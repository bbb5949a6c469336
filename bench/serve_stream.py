"""`bench serve`'s reading of one streamed response: the Server-Sent Events decoded by hand, and
the arrival times of the text chunks turned into a RequestRecord (seconds from the start of the
benchmark)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class SSEDecoder:
    """Incremental Server-Sent Events decoder: feed it bytes as they arrive, get back the data
    of every event completed so far.

    An event ends at a blank line. Bytes are kept until their event is complete, so a multi-byte
    UTF-8 character or a line split across network chunks is decoded whole. Multiple `data:`
    lines of one event are joined by newlines; comments (`:`) and other fields are ignored.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        """Append `chunk` and return the data of each event it completes, in order."""
        # Normalising on the whole buffer also joins a "\r" at the end of one chunk with the
        # "\n" that starts the next.
        self._buffer = (self._buffer + chunk).replace(b"\r\n", b"\n")
        *complete, self._buffer = self._buffer.split(b"\n\n")
        events = []
        for raw in complete:
            data_lines = []
            for line in raw.decode("utf-8", errors="replace").split("\n"):
                if line.startswith("data:"):
                    value = line[len("data:") :]
                    data_lines.append(value[1:] if value.startswith(" ") else value)
            if data_lines:
                events.append("\n".join(data_lines))
        return events


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; `start` is from the start of the benchmark.

    Invariant for a successful request: at least one text chunk arrived (so `ttft` is its time
    after `start`), `itls` holds the gaps between successive text chunks (one fewer than the
    chunks), and the token counts come from the stream's usage chunk.
    """

    success: bool
    start: float = 0.0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2el: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""

    def text_chunk_times(self) -> list[float]:
        """Arrival time of each text chunk, in seconds from the start of the benchmark."""
        t = self.start + self.ttft
        times = [t]
        for gap in self.itls:
            t += gap
            times.append(t)
        return times


def chunk_text(payload: dict[str, Any], endpoint: str) -> str:
    """The generated text a streamed chunk carries ("" for role-only and usage-only chunks)."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        # The first chat chunk may be {"role": "assistant"} alone; it is not a token.
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


class StreamRecorder:
    """Turns the bytes of one streaming response, with their arrival times, into a RequestRecord.

    Kept free of I/O so the timing rules are testable: TTFT is the arrival of the first chunk
    carrying non-empty text, and every later text chunk adds one inter-token latency.
    """

    def __init__(self, endpoint: str, start: float) -> None:
        self.endpoint = endpoint
        self.start = start
        self._decoder = SSEDecoder()
        self._text_times: list[float] = []
        self._usage: dict[str, Any] | None = None
        self._error = ""
        self.done = False

    def feed(self, data: bytes, now: float) -> None:
        """Consume bytes that arrived at time `now` (seconds from the start of the benchmark)."""
        for event in self._decoder.feed(data):
            if self.done or self._error:
                continue
            if event.strip() == "[DONE]":
                self.done = True
                continue
            try:
                payload = json.loads(event)
            except json.JSONDecodeError:
                self._error = f"malformed stream event: {event[:200]!r}"
                continue
            if not isinstance(payload, dict):
                self._error = f"malformed stream event: {event[:200]!r}"
                continue
            if payload.get("error"):
                err = payload["error"]
                self._error = "error event: " + str(
                    err.get("message", err) if isinstance(err, dict) else err
                )
                continue
            if chunk_text(payload, self.endpoint):
                self._text_times.append(now)
            if payload.get("usage"):
                self._usage = payload["usage"]

    def finish(self, now: float, error: str = "") -> RequestRecord:
        """The record of the request, ended at `now`; `error` marks a transport failure."""
        error = error or self._error
        if not error and self._usage is None:
            error = (
                "the stream ended without a usage chunk (is stream_options.include_usage honoured?)"
            )
        if not error and not self._text_times:
            error = "the stream carried no text"
        if error:
            return RequestRecord(
                success=False, start=self.start, e2el=now - self.start, error=error
            )
        assert self._usage is not None
        times = self._text_times
        return RequestRecord(
            success=True,
            start=self.start,
            ttft=times[0] - self.start,
            itls=[b - a for a, b in zip(times, times[1:], strict=False)],
            e2el=now - self.start,
            prompt_tokens=int(self._usage.get("prompt_tokens", 0)),
            completion_tokens=int(self._usage.get("completion_tokens", 0)),
        )
