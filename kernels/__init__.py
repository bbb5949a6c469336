"""pagedserve's kernels: every op behind one backend switch (`kernels/dispatch.py` says how).

Paged attention (sliding windows, soft-capping), KV-cache writes and block copies, RMSNorm, residual
add + RMSNorm, rotary + KV write, SiLU- and GELU-and-multiply, the mixture of experts' routing and
experts, and the LoRA matmuls. Each module's docstring (and each C++ source's header) holds its own
details; here is how they fit.

One contract, three backends
----------------------------

- `reference.py`, pure torch on any device: the oracle. Its docstrings define what each op computes,
  its index arithmetic and its roundings.
- `triton_attention.py`, `triton_fused.py`, `triton_moe.py`, `triton_lora.py`: the GPU twins,
  gathered under the reference's names and signatures by `triton_ops.py`. Under `TRITON_INTERPRET=1`
  they run on CPU tensors, which is how the tests check them.
- `cpu_ops.py`: the compiled CPU backend, C++ where it helps and the reference elsewhere.

`backend.py`'s `KernelBackend` Protocol is the one signature per op that every backend keeps
(tests/kernels/test_backend.py checks them). `dispatch.py` is the switch, re-exported as
`pagedserve.kernels`: `resolve_backend("auto", device)` is `triton` on CUDA, `cpu` on CPU when the
library loads (else `torch`), or what `PAGEDSERVE_ATTENTION_BACKEND` names; the engine resolves once
and calls the module it got. Triton is imported on first use only, so CPU runs never import it.
`validation.py` checks shapes, dtypes, devices and strides (never values) when
`PAGEDSERVE_CHECK_KERNEL_ARGS=1`, as the tests set it. `fp8.py` is the one place for the fp8 KV
cache's rule (write `x / scale` saturated, read `cache * scale` in q's dtype); each layer's scales
are float32 buffers of its `Attention` (engine/models/model.py), read by the kernels from memory, so
scales set in place reach CUDA graphs captured earlier.

The compiled CPU backend
------------------------

`cpu_ops.py` builds and loads one library from `csrc/`: the first of a prebuilt library of the CPU's
level (or a lower one) in the package's `prebuilt/`, this machine's cached build, or a build
compiled now with the system's C++ compiler into pagedserve's cache folder (`paths.py`). File names
hash the sources, flags and torch version, and files are written under a temporary name then
renamed. Any failure is one warning, and "auto" resolves to `torch`.

- `csrc/cpu_attention.cpp`: paged attention read in place through the block table. Work items of
  (sequence, KV head, up to 16 new tokens) share each key and value among the GQA group's query
  heads and run on torch's OpenMP threads, costliest first; the softmax is online in float32;
  head_dim 64 and 128 are compile-time constants.
- `csrc/cpu_layer_ops.cpp`: RMSNorm, residual add + RMSNorm, SiLU-and-multiply, rotary + KV write,
  with the reference's roundings step by step; and the sampler's greedy and temperature-only picks
  (`greedy_pick`, `temperature_pick`, used by engine/worker/sampler.py).
- `csrc/cpu_gguf.cpp`: matmuls by a GGUF file's own blocks, for the weights
  `engine/models/quantized_linear.py` keeps quantized (its docstring and the source's header say
  how: 15-bit activation codes, integer block sums exact in int32; rows interleaved by 8 in
  `engine/models/row_groups.py`; AMX tiles for long bf16 steps with `PAGEDSERVE_BATCH_VARIANT=1`).
- `csrc/cpu_decoder.cpp`: a whole decode step's layers as one call (`engine/models/compiled_step.py`
  says which models and steps), calling the same functions as the ops (`csrc/cpu_kernels.h`); float
  helpers in `csrc/cpu_math.h`.

fp8 caches, `gelu_tanh_and_mul`, `reshape_and_cache`, block copies and the experts' routing and
matmuls take the reference. Every decision taken from the CPU (its level, native bf16, oneDNN's bf16
packing, the block matmuls, the compiler's `-march`) is one function of `cpu_features.py`;
`PAGEDSERVE_CPU_ISA=<level>` makes pagedserve decide as a lesser CPU, and
tests/engine/test_lesser_cpu.py runs the engine's CPU tests that way at `avx2`.

One request, one answer (batch invariance)
------------------------------------------

By default a row's arithmetic is a function of its own inputs and position, never of what else
shares the step, so a request's tokens and logprobs at temperature 0 are the same batched or alone,
cached, chunked, streamed, preempted and recomputed, swapped, drafted for, or beside LoRA requests
(tests/kernels/test_batch_invariance.py op by op, tests/engine/test_one_answer_engine.py and
tests/server/test_one_answer.py end to end). What each part does for it:

- kept GGUF weights: every step takes the block dot products, each activation row quantized alone,
  block sums in one order per row (`quantized_linear.route`);
- dense weights (`engine/models/cpu_linear.py`): oneDNN takes a lone row by another kernel than two
  or more, so a lone row goes through as two;
- attention on CPU: the kernel takes every sequence, each query's keys block by block in order;
- attention on CUDA (`triton_attention.py`): every step runs the one prefill/extend kernel in one
  launch configuration per head layout (`invariant_config`), every key tile masked, no context
  split, no atomics (tests/kernels/test_triton_batch_invariance.py; `ONLY=invariance bash
  benchmarks/gpu_kernels.sh` on a GPU);
- norms, rotary and activations: row by row;
- LoRA on CPU: every step takes the masked path, dense matmuls as above (`engine/lora/layers.py`).

So the KV a prompt writes does not depend on its chunks, and a prefix-cache hit, a recomputed or
swapped-in request and an accepted draft go on exactly as a cold run. `PAGEDSERVE_BATCH_VARIANT=1`
(`cpu_features.batch_variant`, read once per process) turns on the faster paths that give this up:
SDPA for long prompts, AMX tiles for bf16 prefills and one stream's decode keys split across threads
in the attention kernel; the dense and AMX routes for long steps of kept weights; the grouped LoRA
path; one-row oneDNN calls; on CUDA the split-context decode kernel and 128-row extend tiles. What
they gain is measured in docs/benchmarks-history.md ("One request, one answer").

Adding a kernel
---------------

1. The torch reference in `reference.py` (the oracle), its argument check in `validation.py`, its
   signature in `backend.py`, its switch in `dispatch.py`.
2. The Triton twin in a `triton_*.py`, exported by `triton_ops.py` under the same name and
   signature; parity tests under the interpreter in tests/kernels/, a compile variant in
   `benchmarks/kernel_compile.py` and a GPU timing case in `benchmarks/gpu_kernels/`.
3. A C++ CPU version, if it pays: in `csrc/`, registered as a torch op (`TORCH_LIBRARY`), loaded by
   `cpu_ops.py` (which keeps the reference for every op it does not compile), with parity tests in
   tests/kernels/test_cpu_kernel.py.

The folder's name
-----------------

The checkout keeps this folder at its root under the design card's name, `kernels`, which is
also the name of Hugging Face's `kernels` package (transformers imports it, and so
sentence-transformers does through transformers). pagedserve imports this folder only as
`pagedserve.kernels`. Python started in the checkout's root (a user's script beside the README,
`python -c`) puts the root first on sys.path, and an `import kernels` there finds this folder:
then the name is handed to the installed package, as if the folder were not there.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import sys
    from pathlib import Path

    _root = Path(__file__).resolve().parents[1]
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if Path(p or ".").resolve() != _root]
    )
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(
            "No module named 'kernels' (the checkout's kernels/ folder is pagedserve.kernels)",
            name="kernels",
        )
    _installed = importlib.util.module_from_spec(_spec)
    # The import statement returns what sys.modules holds once this file has run: the package.
    sys.modules["kernels"] = _installed
    _spec.loader.exec_module(_installed)
else:
    from pagedserve.kernels.dispatch import *  # noqa: F403
    from pagedserve.kernels.dispatch import __all__  # noqa: F401
