"""`python -m benchmarks.gpu_kernels`: see the package's docstring."""

from __future__ import annotations

import sys

from benchmarks.gpu_kernels.cli import main

if __name__ == "__main__":
    sys.exit(main())
