"""GET /dashboard: one self-contained HTML page (no external assets) that polls GET /v1/kv and
draws the KV-cache pool live. The page itself is server/dashboard.html."""

from __future__ import annotations

import functools
from pathlib import Path

PAGE = Path(__file__).with_name("dashboard.html")


@functools.cache
def dashboard_html() -> str:
    return PAGE.read_text(encoding="utf-8")
