"""`python -m benchmarks.gpu_engine STEP` (see cli.py)."""

from __future__ import annotations

import sys

from benchmarks.gpu_engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
