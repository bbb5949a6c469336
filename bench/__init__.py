"""`pagedserve bench`: the benchmarks a user runs (throughput, serve, soak, quality). The lab's
benchmarks and GPU harnesses are the checkout's benchmarks/ folder, left out of the wheel."""

from __future__ import annotations

import sys
from pathlib import Path


def checkout_root_last() -> None:
    """Put the checkout's root at the end of sys.path, when pagedserve runs from a checkout.

    `python -m` from the checkout puts its root first on sys.path, and there its folders shadow
    installed modules of the same names: Hugging Face's `kernels`, which transformers imports
    while loading a model, above all. pagedserve is imported as `pagedserve.*` (the editable
    install maps it to these folders), so the root is needed only for the tests' helpers
    (`tests.*`), which it still serves from the end. In an installed wheel there is no checkout
    (no pyproject.toml beside the package folders) and nothing changes."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        return
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root] + [str(root)]


checkout_root_last()
