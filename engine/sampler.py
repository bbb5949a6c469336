"""Batched sampling: penalties, temperature, top-k / top-p / min-p, greedy, seeds and logprobs.

Reproducibility: a request with a seed draws its k-th output token with a generator seeded from
(seed, k), so its tokens do not depend on which other requests share the batch, nor on whether it
was preempted and recomputed in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler import SamplingParams

_SEED_STRIDE = 1_000_003  # spreads (seed, position) pairs over distinct generator seeds

# One position: (token logprob, token rank (1 = most likely), [(token id, logprob)] top-k)
TokenLogprobs = tuple[float, int, list[tuple[int, float]]]


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one sequence that samples this step."""

    params: SamplingParams
    num_output_tokens: int
    prompt_token_ids: list[int] | None = None  # only when repetition_penalty != 1
    output_token_ids: list[int] | None = None  # only when any penalty is set


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row when its request asked for logprobs, else None:
    # (chosen token logprob, chosen token rank (1 = most likely), [(token id, logprob)] top-k)
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


def needs_history(params: SamplingParams) -> tuple[bool, bool]:
    """(needs prompt ids, needs output ids) for the penalties of these params."""
    rep = params.repetition_penalty != 1.0
    return rep, rep or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


class Sampler:
    """Samples one token per row of logits [num_rows, vocab]."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} sampling rows")
        logits = logits.float()
        want_logprobs = [r.params.logprobs is not None for r in rows]
        # Logprobs describe the model's distribution before any penalty or temperature.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = self._apply_penalties(logits, rows)

        token_ids = torch.empty(len(rows), dtype=torch.long)
        greedy = [i for i, r in enumerate(rows) if _is_greedy(r.params)]
        if greedy:
            idx = torch.tensor(greedy)
            token_ids[idx] = logits[idx].argmax(dim=-1)
        randoms = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if len(randoms) == len(rows):  # the common case: no row copies
            probs = _filtered_probs(logits, [r.params for r in rows])
            token_ids = self._draw(probs, rows)
        elif randoms:
            idx = torch.tensor(randoms)
            probs = _filtered_probs(logits[idx], [rows[i].params for i in randoms])
            token_ids[idx] = self._draw(probs, [rows[i] for i in randoms])

        chosen = token_ids.tolist()
        logprobs: list[tuple[float, int, list[tuple[int, float]]] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, row in enumerate(rows):
                if want_logprobs[i]:
                    logprobs[i] = _logprobs_of(raw_logprobs[i], chosen[i], row.params.logprobs or 0)
        return SamplerOutput(token_ids=chosen, logprobs=logprobs)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            p = row.params
            if p.repetition_penalty != 1.0 and row.prompt_token_ids is not None:
                seen = torch.tensor(row.prompt_token_ids + (row.output_token_ids or []))
                vals = logits[i, seen]
                # As in the CTRL paper and HF: shrink positive logits, push negative ones further.
                logits[i, seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
            if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
                counts = torch.bincount(
                    torch.tensor(row.output_token_ids), minlength=logits.shape[1]
                )[: logits.shape[1]].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                    logits.dtype
                )
        return logits

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # One uniform number per row; a seeded row draws it from its own (seed, position) stream.
        uniforms = torch.empty(len(rows), dtype=torch.float64)
        for i, row in enumerate(rows):
            gen = self.generator
            if row.params.seed is not None:
                seed = (row.params.seed * _SEED_STRIDE + row.num_output_tokens) % (2**63 - 1)
                gen = torch.Generator().manual_seed(seed)
            uniforms[i] = torch.rand(1, generator=gen, dtype=torch.float64)[0]
        return inverse_cdf_sample(probs, uniforms)


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
    inner = chunks[torch.arange(num_rows), c.squeeze(1)].double().cumsum(dim=-1)  # [rows, chunk]
    j = torch.searchsorted(inner, remaining, right=True)
    # Rounding can put `remaining` at or past the chunk's total: take its last non-zero token.
    last_nonzero = (inner < inner[:, -1:]).sum(dim=-1, keepdim=True)
    j = torch.minimum(j, last_nonzero)
    return (c * chunk + j).squeeze(1)


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature == 0.0 or p.top_k == 1


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks; returns probabilities [rows, vocab]."""
    if any(p.temperature != 1.0 for p in params):
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        logits = logits / temps.unsqueeze(1)
    vocab = logits.shape[1]
    top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]
    if any(k < vocab for k in top_ks) or any(p.top_p < 1.0 for p in params):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ks = torch.tensor(top_ks).unsqueeze(1)
        ranks = torch.arange(vocab).unsqueeze(0)
        drop = ranks >= ks
        top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype).unsqueeze(1)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
        # already reaches top_p (the first token is always kept).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_ps
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)
    probs = logits.softmax(dim=-1)
    min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
    if (min_ps > 0).any():
        threshold = min_ps * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]
) -> list[TokenLogprobs]:
    """Logprob and rank of `token_ids[i]` under row i of `logits` [rows, vocab], plus the row's
    `ks[i]` most likely tokens (prompt logprobs: the tokens are given, not sampled).

    The same numbers as a sampled token's logprobs: log_softmax of the float32 logits, before any
    penalty or temperature, rank = 1 + number of strictly more likely tokens. Computed on the
    logits' device; only [rows, max k] values travel to the host.
    """
    if logits.shape[0] != token_ids.shape[0] or logits.shape[0] != len(ks):
        raise ValueError(
            f"{logits.shape[0]} rows of logits for {token_ids.shape[0]} token ids and {len(ks)} ks"
        )
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_vals, top_ids = logprobs.topk(min(max(ks, default=0), logprobs.shape[1]), dim=-1)
    chosen_list, rank_list = chosen.squeeze(1).tolist(), ranks.tolist()
    top_vals_list, top_ids_list = top_vals.tolist(), top_ids.tolist()
    return [
        (
            chosen_list[i],
            rank_list[i],
            list(zip(top_ids_list[i][:k], top_vals_list[i][:k], strict=True)),
        )
        for i, k in enumerate(ks)
    ]


def _logprobs_of(
    row_logprobs: torch.Tensor, chosen: int, k: int
) -> tuple[float, int, list[tuple[int, float]]]:
    chosen_lp = row_logprobs[chosen]
    rank = int((row_logprobs > chosen_lp).sum().item()) + 1
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, ids = row_logprobs.topk(k)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return float(chosen_lp.item()), rank, top
