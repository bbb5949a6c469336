"""GPU benchmark of the Triton kernels: correctness against the torch reference first, then speed
against torch's own kernels, both measured side by side in one run.

    python -m benchmarks.gpu_kernels                        # every case on a CUDA device
    python -m benchmarks.gpu_kernels --only decode,cache --out $OUT/kernels.jsonl
    python -m benchmarks.gpu_kernels --only fused           # the fused layer ops alone
    python -m benchmarks.gpu_kernels --only copy            # copy_blocks alone
    python -m benchmarks.gpu_kernels --only moe             # the fused MoE alone
    python -m benchmarks.gpu_kernels --sweep                # launch configurations instead
    python -m benchmarks.gpu_kernels --invariance           # one request, one answer
    TRITON_INTERPRET=1 python -m benchmarks.gpu_kernels --smoke   # tiny shapes, also on CPU

Scenarios, in bf16 (--dtype) over a paged cache of block size 16 whose blocks lie in a random
permutation (the scatter a long-running server's block pool ends up with):

  decode   one new token per sequence, every sequence `context` tokens long. Memory-bound, so it
           is reported as K/V bytes read per second, against SDPA reading the same K/V from
           contiguous [B, Hkv, L, D] tensors (the best a paged kernel can hope to match).
           For the Llama-3.1-8B cases also over an fp8 (e4m3) cache of the same K/V, scaled by
           `kv_scale_from_amax` (a second "decode" record, kv_dtype "fp8"): bytes/s at one byte
           per element, and its time against the kernel over the bf16 cache (`time_vs_base`;
           `ratio` is the speed-up). Checked against the reference on the same fp8 cache, and
           once more after the scales change in place (as the engine's calibration changes them),
           through the same CUDA graph with --cuda-graph: the kernels must read the scales from
           memory at every call.
  prefill  8 sequences of new tokens, with no prefix and on a 2048-token cached prefix.
           Compute-bound, so it is reported as TFLOP/s over the (query, key) pairs the causal mask
           lets through, against SDPA on contiguous tensors with the same causal mask.
  cache    reshape_and_cache of 65536 tokens to a random permutation of slots: GB/s of K and V
           written, against the torch reference (index_copy_).
  copy     copy_blocks, the copy-on-write of shared blocks, of 1, 64 and 256 blocks in each of
           32 layers' K and V caches (Llama-3.1-8B heads) at once, between random blocks of a
           1024-block pool: GB/s of the bytes moved (each block read once and written once),
           against the torch reference (index_select + index_copy_ per cache). Eager, as the
           Triton wrapper copies the caches' addresses from the host on every call.
  fused    the decoder's non-attention ops (`kernels.triton_fused`: rms_norm, fused_add_rms_norm,
           silu_and_mul, rotary_and_cache) at Llama-3.2-1B's layer shape for 1, 256 and 4096
           tokens. Memory-bound: GB/s of the bytes each op must move (its inputs read once, its
           outputs written once), against the torch reference of the same op and against the
           unfused torch code the model ran before the fused ops ("model": an out-of-place
           residual add before the norm; rotary on the stacked q/k view, then the attention
           backend's reshape_and_cache), timed eagerly. Checked to 2 ulps of the dtype, see
           FUSED_RTOL.
  moe      the experts of a mixture-of-experts layer (`kernels.triton_moe.fused_moe`) at
           Qwen3-30B-A3B's (hidden 2048, experts of 768, 128 experts, top 8) and Mixtral-8x7B's
           (4096, 14336, 8, top 2) shapes for 1, 16 and 256 tokens routed by `moe_route` on
           random logits. TFLOP/s over the active parameters (2 x 3 x I x hidden per token and
           expert), against the torch reference (a loop over the experts that received tokens)
           and against the dense layer of the same active size and FLOPs (one [T, hidden] x
           [hidden, 2 x I x top_k] matmul, SiLU-and-multiply, one [T, I x top_k] x
           [I x top_k, hidden] matmul); GB/s of the distinct experts' weights read in the JSON.
           Eager (the reference syncs with the host).

--invariance replaces them with the checks and costs of the batch-invariant default
(invariance.py): one stream's queries bit for bit the same alone, among other decodes, in mixed
steps and in chunks; then decode and prefill steps timed by default and with
PAGEDSERVE_BATCH_VARIANT=1, the split-context decode kernel's dispatch.

Before it is timed, each case's Triton output is compared with `kernels.reference` in the same
dtype on the same device (attention: |triton - ref| <= ATOL + RTOL * |ref|; the cache write must
match exactly, and so must every cache after copy_blocks). A failed check, or a case that raises,
is reported and the run goes on. Timing is do_bench's median on CUDA; on CPU (--smoke) a
wall-clock median that only proves the path runs.

stdout carries one JSON line per record (the environment, each check, each measurement; `--out`
writes the same lines to a file) and the summary table goes to stderr, so stdout stays parseable.
Exit status: 0 every check passed, 1 a check failed or a case raised, 2 nothing could run. Speed
targets are reported (`target`, `ok`) but do not change the exit status.

The package: plans.py (the shapes and cases of FULL and SMOKE), harness.py (what every case
shares: setup, report, timer, check), one module per scenario family (attention.py: decode and
prefill; cache.py: cache and copy; fused.py; moe.py), sweep.py (--sweep), invariance.py
(--invariance) and cli.py (the command).
"""

from __future__ import annotations

from benchmarks.gpu_kernels.cli import build_parser, main

__all__ = ["build_parser", "main"]
