"""Where pagedserve keeps what it computes once per machine: converted GGUF tokenizers
(`engine.frontend.tokenizer`) and the compiled CPU kernel (`kernels.cpu_ops`). Here, in the lowest
package, so that both can read it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path | None:
    """pagedserve's cache folder: $PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve, else
    ~/.cache/pagedserve. PAGEDSERVE_CACHE_DIR set to the empty string turns the cache off."""
    explicit = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if explicit is not None:
        return Path(explicit).expanduser() if explicit else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedserve"
