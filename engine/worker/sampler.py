"""Batched sampling: penalties, temperature, top-k / top-p / min-p, greedy, seeds and logprobs.

Reproducibility: a request with a seed draws its k-th output token from a uniform number that
depends only on (seed, k) (`seeded_uniform`), so its tokens do not depend on which other requests
share the batch, nor on whether it was preempted and recomputed in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from pagedserve.engine.messages import TokenLogprobs
from pagedserve.engine.worker.token_rules import TokenRules
from pagedserve.kernels import cpu_ops
from pagedserve.scheduler import SamplingParams

_SEED_STRIDE = 1_000_003  # spreads (seed, position) pairs over distinct stream positions
_MASK64 = (1 << 64) - 1


class SamplingRow(NamedTuple):
    """What the sampler needs to know about one sequence that samples this step (a tuple: one is
    built per sequence per step)."""

    params: SamplingParams
    num_output_tokens: int
    prompt_token_ids: list[int] | None = None  # only when repetition_penalty != 1
    output_token_ids: list[int] | None = None  # only when a penalty or a bad word reads it


def _compiled_greedy(logits: torch.Tensor, plan: SamplingPlan) -> bool:
    """Whether the batch takes the compiled greedy pick (`cpu_ops.greedy_pick`: the max and the
    finite check in one pass): CPU float32 logits, every row greedy, no rule, penalty or grammar
    changing the logits first."""
    return (
        not plan.randoms
        and plan.rules is None
        and not plan.penalized
        and plan.allowed is None
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and cpu_ops.available()
    )


def _compiled_temperature(logits: torch.Tensor, plan: SamplingPlan) -> bool:
    """Whether the batch takes the compiled draw (`cpu_ops.temperature_pick`): CPU float32
    logits, every row sampling by its temperature alone (no top-k, top-p or min-p), no rule,
    penalty or grammar changing the logits first."""
    vocab = logits.shape[-1]
    return (
        bool(plan.randoms)
        and plan.random_idx is None
        and plan.rules is None
        and not plan.penalized
        and plan.allowed is None
        and logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and all(
            (p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0
            for p in (row.params for row in plan.rows)
        )
        and cpu_ops.available()
    )


@dataclass(frozen=True)
class SamplingPlan:
    """What `Sampler.plan` decides on the host for one batch of rows."""

    rows: list[SamplingRow]
    randoms: list[int]  # rows that sample (the others take the argmax)
    random_idx: torch.Tensor | None  # their indices, when only some rows sample
    uniforms: torch.Tensor | None  # one per sampling row
    asking: list[int]  # rows that want logprobs
    asking_idx: torch.Tensor | None
    penalized: bool  # some row has a penalty (its history is attached)
    # Structured outputs: the constrained rows and every row's allowed tokens as an int32
    # bitmask [rows, words] (engine/structured_output.py says the layout; unconstrained rows
    # all ones); None when no row is constrained.
    allowed: tuple[list[int], torch.Tensor] | None = None
    # logit_bias, allowed_token_ids, bad words, min_tokens (engine/worker/token_rules.py).
    rules: TokenRules | None = None


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index of its largest value as argmax gives it, through
    max(dim): on CPU 2.5-4x faster than argmax at [64-256, 49152] (docs/benchmarks-history.md, "The
    decode step as one call")."""
    return logits.max(dim=-1).indices


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row when its request asked for logprobs, else None:
    # (chosen token logprob, chosen token rank (1 = most likely), [(token id, logprob)] top-k)
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]
    # Rows whose logits held a NaN or an infinity: their token is a placeholder (0), and the
    # engine fails their requests instead of sampling garbage.
    nonfinite_rows: list[int] = field(default_factory=list)


class Sampler:
    """Samples one token per row of logits [num_rows, vocab], on the logits' device.

    The whole batch is handled by tensor ops; per-row parameters travel to the device in a few
    small non-blocking copies, and the only device-to-host transfer is the sampled ids (plus the
    logprobs of rows that asked for them)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        # What min_tokens keeps from being sampled besides a request's stop_token_ids (the
        # engine core sets the model's EOS ids).
        self.eos_token_ids: frozenset[int] = frozenset()

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, self.plan(rows, logits.device)).to_host()

    def plan(
        self,
        rows: list[SamplingRow],
        device: torch.device,
        allowed: tuple[list[int], np.ndarray] | None = None,
    ) -> SamplingPlan:
        """The host's part of sampling these rows: which are greedy, which want logprobs, and
        the random numbers, decided before the logits exist; `allowed` is (the rows under a
        grammar, the token bitmasks of all rows [len(rows), words]). A runner that overlaps
        steps calls it on the host thread and leaves `sample` (tensor work) to the device's
        turn."""
        greedy = [r.params.greedy for r in rows]
        randoms = [i for i, g in enumerate(greedy) if not g]
        random_rows = [rows[i] for i in randoms]
        asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        return SamplingPlan(
            rows=rows,
            randoms=randoms,
            random_idx=None
            if len(randoms) in (0, len(rows))
            else to_device(randoms, torch.long, device),
            uniforms=self._uniforms(random_rows, device) if randoms else None,
            asking=asking,
            asking_idx=to_device(asking, torch.long, device) if asking else None,
            penalized=any(r.output_token_ids is not None and _penalized(r.params) for r in rows),
            allowed=None
            if allowed is None
            else (allowed[0], to_device(torch.from_numpy(allowed[1]), torch.int32, device)),
            rules=TokenRules.plan(rows, self.eos_token_ids, device),
        )

    def sample(self, logits: torch.Tensor, plan: SamplingPlan) -> DeviceSample:
        """Sample on the logits' device; nothing waits for the device until `to_host()`."""
        rows = plan.rows
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} sampling rows")
        if _compiled_greedy(logits, plan):
            token_ids, finite = cpu_ops.greedy_pick(logits)
        elif _compiled_temperature(logits, plan):
            temperatures = [row.params.temperature for row in rows]
            token_ids, finite = cpu_ops.temperature_pick(logits, temperatures, plan.uniforms)
        else:
            token_ids, finite = self._sample(logits, plan)
        # Logprobs describe the model's distribution before any rule, penalty or temperature
        # (vLLM's default, "raw_logprobs": a +-100 logit_bias does not show in them).
        logprobs = None
        if plan.asking:
            idx = plan.asking_idx
            ks = [rows[i].params.logprobs or 0 for i in plan.asking]
            logprobs = LogprobTensors.compute(logits[idx], token_ids[idx], ks)
        return DeviceSample(token_ids, finite, plan.asking, logprobs)

    def _sample(
        self, logits: torch.Tensor, plan: SamplingPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The token ids, and which rows' logits were finite (the others' ids are 0)."""
        rows = plan.rows
        raw_logits = logits
        logits = logits.float()
        # A row with a NaN or an infinity (a broken model or an overflow on this input) samples an
        # arbitrary index, maybe past the vocabulary; the next step may read it on the device before
        # the host sees it, so it becomes token 0 below, and `finite` tells the host. Checked
        # through each row's max and min (both NaN when the row holds a NaN): on CPU two reductions
        # take 0.2 ms at [64, 49152], isfinite(logits).all() 5.6 ms (docs/benchmarks-history.md).
        finite = torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))
        if plan.rules is not None:  # before penalties, as vLLM
            if logits is raw_logits:
                logits = logits.clone()  # the raw logits still give the logprobs
            plan.rules.apply(logits)
            # Rules that leave a row no token (allowed_token_ids all banned, or outside its
            # grammar): the row fails like a non-finite one (EngineCore says why).
            finite &= logits.amax(dim=-1) > float("-inf")
        if plan.penalized:
            logits = self._apply_penalties(logits, rows)
        if plan.allowed is not None:
            if logits is raw_logits:
                logits = logits.clone()  # the raw logits still give the logprobs
            apply_token_bitmask(logits, *plan.allowed)
            if plan.rules is not None:
                finite &= logits.amax(dim=-1) > float("-inf")
        if not plan.randoms:
            token_ids = _greedy(logits)
        elif plan.random_idx is None:  # the common case: every row samples, no row copies
            probs = _filtered_probs(logits, [r.params for r in rows])
            token_ids = inverse_cdf_sample(probs, plan.uniforms)
        else:
            idx = plan.random_idx
            probs = _filtered_probs(logits[idx], [rows[i].params for i in plan.randoms])
            drawn = inverse_cdf_sample(probs, plan.uniforms)
            token_ids = _greedy(logits).index_copy_(0, idx, drawn)

        return token_ids.masked_fill(~finite, 0), finite

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Repetition, frequency and presence penalties for every row at once, from flat
        (row, token id) index lists: one gather/scatter per kind instead of one per row."""
        rep_rows, rep_ids, rep_values = [], [], []
        out_rows, out_ids = [], []
        for i, row in enumerate(rows):
            p = row.params
            if p.repetition_penalty != 1.0 and row.prompt_token_ids is not None:
                seen = row.prompt_token_ids + (row.output_token_ids or [])
                rep_rows += [i] * len(seen)
                rep_ids += seen
                rep_values.append(p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
                out_rows += [i] * len(row.output_token_ids)
                out_ids += row.output_token_ids
        device = logits.device
        if rep_rows or out_rows:
            logits = logits.clone()  # the caller's logits still give the unpenalised logprobs
        if rep_rows:
            r = to_device(rep_rows, torch.long, device)
            t = to_device(rep_ids, torch.long, device)
            penalty = to_device(
                [rows[i].params.repetition_penalty for i in range(len(rows))], logits.dtype, device
            )[r]
            vals = logits[r, t]
            # As in the CTRL paper and HF: shrink positive logits, push negative ones further.
            # (A token seen twice is written twice with the same value.)
            logits[r, t] = torch.where(vals > 0, vals / penalty, vals * penalty)
        if out_rows:
            counts = torch.zeros_like(logits)
            counts.index_put_(
                (to_device(out_rows, torch.long, device), to_device(out_ids, torch.long, device)),
                torch.ones((), dtype=logits.dtype, device=device),
                accumulate=True,
            )
            freq = to_device([r.params.frequency_penalty for r in rows], logits.dtype, device)
            pres = to_device([r.params.presence_penalty for r in rows], logits.dtype, device)
            logits -= freq[:, None] * counts + pres[:, None] * (counts > 0).to(logits.dtype)
        # A tiny repetition_penalty divides a logit into infinity: keep it the largest finite
        # value instead, so the row still samples (infinities make the softmax NaN).
        finite_max = torch.finfo(logits.dtype).max
        return logits.clamp_(-finite_max, finite_max) if rep_rows else logits

    def _uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """One uniform number per row, drawn on the host (so seeds reproduce on any device): a
        seeded row from its own (seed, position) stream, the others from the engine's stream."""
        uniforms = torch.empty(len(rows), dtype=torch.float64)
        unseeded = [i for i, row in enumerate(rows) if row.params.seed is None]
        if unseeded:
            draws = torch.rand(len(unseeded), generator=self.generator, dtype=torch.float64)
            uniforms[unseeded] = draws
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                uniforms[i] = seeded_uniform(row.params.seed, row.num_output_tokens)
        return to_device(uniforms, torch.float64, device)


def _penalized(params: SamplingParams) -> bool:
    return bool(
        params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
    )


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: every token the bitmask of its row forbids gets -inf, in `rows` (bitmask
    [len(logits), words] int32: bit i % 32 of word i // 32 allows token i). One masked fill for
    the batch on the logits' device, by the grammar library's kernel (C++ on CPU, Triton on
    CUDA); three times faster on CPU than unpacking the bits with torch ops
    (docs/benchmarks-history.md, "Structured outputs")."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position): SplitMix64's output
    function on seed * stride + position, top 53 bits. Plain integer arithmetic, so a seeded
    row needs no torch.Generator built and seeded per step."""
    z = (seed * _SEED_STRIDE + position + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def to_device(
    values: list | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A host list or tensor on `device` without a host sync: through pinned memory with a
    non-blocking copy on CUDA, as is on CPU."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def inverse_cdf_sample(
    probs: torch.Tensor, uniforms: torch.Tensor, chunk: int = 1024
) -> torch.Tensor:
    """Pick, per row, the first token whose cumulative probability exceeds u * total mass.

    Two levels, so no cumulative sum runs over the whole vocabulary (slow and, in float32,
    inexact): the vocabulary is cut into chunks, the chunk is found from the chunk masses, then
    the token inside that one chunk.

        probs  [p0 p1 ... p1023 | p1024 ... p2047 | ...]     chunk masses m0, m1, ...
        target = u * (m0 + m1 + ...)  ->  chunk c: first with m0 + ... + mc > target
        inside c: first token j with p(c,0) + ... + p(c,j) > target - (m0 + ... + m(c-1))

    A token of probability 0 is never picked: its cumulative value equals its predecessor's.
    """
    num_rows, vocab = probs.shape
    pad = (-vocab) % chunk
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    chunks = probs.view(num_rows, -1, chunk)
    mass = chunks.sum(dim=-1).double()  # [rows, num_chunks]; float32 sums of 1024 are exact enough
    mass_cdf = mass.cumsum(dim=-1)
    target = (uniforms * mass_cdf[:, -1]).unsqueeze(1)  # [rows, 1]
    c = torch.searchsorted(mass_cdf, target, right=True).clamp_(max=mass.shape[1] - 1)
    remaining = target - (mass_cdf.gather(1, c) - mass.gather(1, c))
    rows = torch.arange(num_rows, device=probs.device)
    inner = chunks[rows, c.squeeze(1)].double().cumsum(dim=-1)  # [rows, chunk]
    j = torch.searchsorted(inner, remaining, right=True)
    # Rounding can put `remaining` at or past the chunk's total: take its last non-zero token.
    last_nonzero = (inner < inner[:, -1:]).sum(dim=-1, keepdim=True)
    j = torch.minimum(j, last_nonzero)
    return (c * chunk + j).squeeze(1)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks; returns probabilities [rows, vocab].
    Which masks run is decided from the host-side params, never from device values."""
    device = logits.device
    if any(p.temperature != 1.0 for p in params):
        temps = to_device([p.temperature for p in params], logits.dtype, device)
        logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[1]
    top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]
    if any(k < vocab for k in top_ks) or any(p.top_p < 1.0 for p in params):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ks = to_device(top_ks, torch.long, device).unsqueeze(1)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= ks
        top_ps = to_device([p.top_p for p in params], logits.dtype, device).unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
        # already reaches top_p (the first token is always kept).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_ps
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_ps = to_device([p.min_p for p in params], probs.dtype, device).unsqueeze(1)
        threshold = min_ps * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]
) -> list[TokenLogprobs]:
    """Logprob and rank of `token_ids[i]` under row i of `logits` [rows, vocab], plus the row's
    `ks[i]` most likely tokens (prompt logprobs: the tokens are given, not sampled)."""
    return LogprobTensors.compute(logits, token_ids, ks).to_host()


@dataclass
class LogprobTensors:
    """Logprobs computed on the device, turned into lists by `to_host()`.

    The same numbers as a sampled token's logprobs: log_softmax of the float32 logits, before any
    penalty or temperature, rank = 1 + number of strictly more likely tokens. Only [rows, max k]
    values travel to the host.
    """

    chosen: torch.Tensor  # [rows]
    ranks: torch.Tensor  # [rows]
    top_vals: torch.Tensor  # [rows, max k]
    top_ids: torch.Tensor  # [rows, max k]
    ks: list[int]

    @classmethod
    def compute(
        cls, logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]
    ) -> LogprobTensors:
        if logits.shape[0] != token_ids.shape[0] or logits.shape[0] != len(ks):
            raise ValueError(
                f"{logits.shape[0]} rows of logits for {token_ids.shape[0]} token ids and "
                f"{len(ks)} ks"
            )
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top_vals, top_ids = logprobs.topk(min(max(ks, default=0), logprobs.shape[1]), dim=-1)
        return cls(chosen.squeeze(1), ranks, top_vals, top_ids, ks)

    def map(self, fn) -> LogprobTensors:
        """The same logprobs with `fn` applied to every tensor (e.g. a copy to the host)."""
        return LogprobTensors(
            fn(self.chosen), fn(self.ranks), fn(self.top_vals), fn(self.top_ids), self.ks
        )

    def to_host(self) -> list[TokenLogprobs]:
        chosen_list, rank_list = self.chosen.tolist(), self.ranks.tolist()
        top_vals_list, top_ids_list = self.top_vals.tolist(), self.top_ids.tolist()
        return [
            (
                chosen_list[i],
                rank_list[i],
                list(zip(top_ids_list[i][:k], top_vals_list[i][:k], strict=True)),
            )
            for i, k in enumerate(self.ks)
        ]


@dataclass
class DeviceSample:
    """A step's sampled ids (and logprobs of the rows that asked) still on the device."""

    token_ids: torch.Tensor  # [rows]
    finite: torch.Tensor  # [rows] bool: False where the row's logits were not all finite
    logprob_rows: list[int]
    logprobs: LogprobTensors | None

    def map(self, fn) -> DeviceSample:
        """The same sample with `fn` applied to every tensor (e.g. a copy to the host)."""
        return DeviceSample(
            fn(self.token_ids),
            fn(self.finite),
            self.logprob_rows,
            None if self.logprobs is None else self.logprobs.map(fn),
        )

    def to_host(self) -> SamplerOutput:
        logprobs: list[TokenLogprobs | None] = [None] * self.token_ids.shape[0]
        if self.logprobs is not None:
            for i, entry in zip(self.logprob_rows, self.logprobs.to_host(), strict=True):
                logprobs[i] = entry
        nonfinite = [] if self.finite.all() else (~self.finite).nonzero().flatten().tolist()
        return SamplerOutput(self.token_ids.tolist(), logprobs, nonfinite)
