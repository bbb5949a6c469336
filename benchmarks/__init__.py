"""The lab's benchmarks, kept in the checkout and out of the wheel: the scripts behind
BENCHMARKS.md's numbers (CPU microbenchmarks, KV capacity, LoRA, speculative decoding, ...), the
GPU-proof harnesses (gpu_engine/, gpu_kernels/ and their shell scripts) and the comparison runs
against transformers and other engines (compare_*.py, peers/).

Run them from the checkout's root, as modules: `python -m benchmarks.host_step`. What a user of
an installed pagedserve runs is `pagedserve bench` (the `pagedserve.bench` package), which these
scripts build on; nothing in the product imports this folder.
"""

from __future__ import annotations

from pagedserve.bench import checkout_root_last

# `python -m benchmarks.X` puts the checkout's root first on sys.path, where kernels/ would
# shadow Hugging Face's `kernels` (bench/__init__.py says more): move it to the end.
checkout_root_last()
