"""Continuous batching for Whisper transcriptions: requests of one 30-second window each
run together, step by step, over one block pool holding two KV groups per request: the decoder's
self-attention blocks and the cross-attention blocks of its encoder states.

- **Admission.** A request enters when the pool has its cross-attention blocks
  (ceil(max_source_positions / block_size)) and the self-attention blocks of its longest
  decoding (prompt + max_tokens, at most max_target_positions) free, and fewer than
  `max_num_seqs` run; otherwise it waits, in arrival order. Everything is allocated at
  admission, so a running request never waits for a block and nothing is preempted.
- **Encoder work counts against the step.** Each admitted request costs max_source_positions
  tokens of the step's `max_num_batched_tokens` (at least one admission per step); the encoder
  runs once, batched over the step's admissions, and their cross-attention K/V are written into
  their blocks once (`WhisperModel.write_cross_kv`).
- **Decoding.** One forward per step over every running request's new tokens (its prompt in its
  first step, then its last token), `WhisperModel.decode_paged`; greedy, or sampling at a
  temperature with a seeded generator. As transformers' `generate` does with the model's
  generation config, `suppress_tokens` are never chosen and `begin_suppress_tokens` not as the
  first token.
- **Freeing.** A request that ends (end of text, max_tokens, the decoder's last position) or is
  aborted gives both groups back at once.

The block pool is the scheduler's (`scheduler.block_pool.BlockPool`); the KV tensors are one K
and one V tensor per decoder layer, [num_blocks, block_size, heads, head_dim], a block id
belonging to one group of one request at a time, as in the decoder-only engine.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedserve import kernels
from pagedserve.engine.messages import EngineStats
from pagedserve.engine.models.whisper import PagedBatch, WhisperModel, cross_batch
from pagedserve.kernels.backend import KernelBackend
from pagedserve.scheduler.block_pool import Block, BlockPool
from pagedserve.scheduler.utils import cdiv


@dataclass
class TranscriptionRequest:
    request_id: str
    features: torch.Tensor  # [num_mel_bins, 2 x max_source_positions]
    prompt: list[int]  # the decoder's prefix (start of transcript, language, task ...)
    max_tokens: int
    temperature: float = 0.0
    output: list[int] = field(default_factory=list)
    cross_blocks: list[Block] = field(default_factory=list)
    self_blocks: list[Block] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"


class WhisperEngine:
    """Transcription requests over one `WhisperModel`: `add`, `abort`, `step` (the requests that
    finished in it), `run` (all)."""

    def __init__(
        self,
        model: WhisperModel,
        num_blocks: int,
        *,
        block_size: int = 16,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        ops: KernelBackend = kernels.reference,
        seed: int = 0,
        suppress_tokens: Sequence[int] = (),
        begin_suppress_tokens: Sequence[int] = (),
    ) -> None:
        c = model.config
        self.model, self.ops, self.block_size = model, ops, block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.cross_blocks_per_request = cdiv(c.max_source_positions, block_size)
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        shape = (num_blocks, block_size, c.decoder_attention_heads, c.head_dim)
        self.caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(c.decoder_layers)
        ]
        # Ids past the vocabulary are dropped: transformers' default config names GPT-2's ids
        # (220, 50256), which a small vocabulary does not have.
        self.suppress = self._token_ids(suppress_tokens)
        self.begin_suppress = self._token_ids(begin_suppress_tokens)
        self.waiting: collections.deque[TranscriptionRequest] = collections.deque()
        self.running: list[TranscriptionRequest] = []
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.num_requests_added = 0
        self.num_steps = 0
        self.step_seconds = 0.0

    def _token_ids(self, ids: Sequence[int]) -> torch.Tensor:
        vocab = self.model.config.vocab_size
        kept = sorted({int(i) for i in ids if 0 <= int(i) < vocab})
        return torch.tensor(kept, dtype=torch.int64, device=self.device)

    def blocks_needed(self, request: TranscriptionRequest) -> int:
        """Blocks the request holds while it runs: its cross-attention blocks and those of its
        longest decoding."""
        return self._blocks_for(len(request.prompt), request.max_tokens)

    def _blocks_for(self, prompt_len: int, max_tokens: int) -> int:
        tokens = min(prompt_len + max_tokens, self.model.config.max_target_positions)
        return self.cross_blocks_per_request + cdiv(tokens, self.block_size)

    def add(self, request: TranscriptionRequest) -> None:
        """Queue a request (`check`ed first)."""
        self.check(request)
        self.waiting.append(request)
        self.num_requests_added += 1

    def check(self, request: TranscriptionRequest) -> None:
        """ValueError, saying what to change, for a request this engine cannot run. Reads only
        what never changes, so any thread may call it."""
        c = self.model.config
        if request.features.shape != (c.num_mel_bins, c.num_frames):
            raise ValueError(
                f"features must be [{c.num_mel_bins}, {c.num_frames}], got "
                f"{tuple(request.features.shape)}"
            )
        self.check_decoding(request.prompt, request.max_tokens, request.temperature)

    def check_decoding(self, prompt: list[int], max_tokens: int, temperature: float) -> None:
        """`check` without the features: what a request decoding from `prompt` needs."""
        c = self.model.config
        if not prompt or len(prompt) >= c.max_target_positions:
            raise ValueError(
                f"the decoder prompt must hold 1 to {c.max_target_positions - 1} tokens, got "
                f"{len(prompt)}"
            )
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        need = self._blocks_for(len(prompt), max_tokens)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"a request needs {need} KV blocks ({self.cross_blocks_per_request} for "
                f"cross-attention), the pool has {self.pool.num_blocks}: give the cache more "
                "blocks"
            )
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")

    def abort(self, request_id: str) -> bool:
        """End a request, waiting or running, freeing both its groups; False if unknown."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self._finish(request, "abort")
                    return True
        return False

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> EngineStats:
        """The decoder-only engine's stats, for the same /metrics families."""
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_used=self.pool.num_blocks - self.pool.num_free_blocks,
            kv_blocks_total=self.pool.num_blocks,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            num_requests_added=self.num_requests_added,
        )

    # ---- a step ------------------------------------------------------------------------------

    def _admit(self) -> list[TranscriptionRequest]:
        admitted: list[TranscriptionRequest] = []
        budget = self.max_num_batched_tokens
        positions = self.model.config.max_source_positions
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if admitted and budget < positions:
                break  # the step's encoder work is spent
            need = self.blocks_needed(request)
            if need > self.pool.num_free_blocks:
                break  # in arrival order: the head waits, and so do those behind it
            self.waiting.popleft()
            blocks = self.pool.allocate(need)
            request.cross_blocks = blocks[: self.cross_blocks_per_request]
            request.self_blocks = blocks[self.cross_blocks_per_request :]
            admitted.append(request)
            self.running.append(request)
            budget -= positions
        return admitted

    def _encode(self, admitted: list[TranscriptionRequest]) -> None:
        model = self.model
        features = torch.stack([r.features for r in admitted]).to(self.device, self.dtype)
        positions = torch.arange(model.config.max_source_positions)
        slots = torch.stack([
            torch.tensor([b.block_id for b in r.cross_blocks])[positions // self.block_size]
            * self.block_size + positions % self.block_size
            for r in admitted
        ]).to(self.device)  # fmt: skip
        model.write_cross_kv(model.cross_kv(model.encode(features)), self.caches, slots, self.ops)

    def step(self) -> list[TranscriptionRequest]:
        """Admit and encode what fits, decode one token for every running request; the
        requests that finished in this step."""
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.num_steps += 1
            self.step_seconds += time.perf_counter() - start

    @torch.inference_mode()
    def _step(self) -> list[TranscriptionRequest]:
        admitted = self._admit()
        if admitted:
            self._encode(admitted)
        if not self.running:
            return []
        bs = self.block_size
        tokens, positions, slots, owners, starts = [], [], [], [], [0]
        for r in self.running:
            new = r.prompt if not r.output else r.output[-1:]
            first = len(r.prompt) + len(r.output) - len(new)
            for j, token in enumerate(new):
                p = first + j
                tokens.append(token)
                positions.append(p)
                slots.append(r.self_blocks[p // bs].block_id * bs + p % bs)
                owners.append(r)
            starts.append(starts[-1] + len(new))
        width = max(len(r.self_blocks) for r in self.running)
        tables = [[b.block_id for b in r.self_blocks] for r in self.running]
        self_batch = PagedBatch(
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            torch.tensor([len(r.prompt) + len(r.output) for r in self.running], dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32),
            torch.tensor(slots),
        )
        cross = cross_batch(
            [[b.block_id for b in r.cross_blocks] for r in owners],
            self.model.config.max_source_positions,
        )
        on_device = lambda batch: PagedBatch(*(t.to(self.device) for t in batch))  # noqa: E731
        logits = self.model.decode_paged(
            torch.tensor(tokens, device=self.device), torch.tensor(positions, device=self.device),
            self.caches, on_device(self_batch), self.caches, on_device(cross), self.ops,
        )  # fmt: skip
        finished = []
        last = logits[torch.tensor(starts[1:], device=self.device) - 1].float()
        chosen = self._sample(last, [not r.output for r in self.running],
                              [r.temperature for r in self.running])  # fmt: skip
        for r, token in zip(list(self.running), chosen, strict=True):
            r.output.append(token)
            reason = self._stop_reason(r, token)
            if reason is not None:
                self.running.remove(r)
                self._finish(r, reason)
                finished.append(r)
        return finished

    def _sample(
        self, logits: torch.Tensor, first: list[bool], temperatures: list[float]
    ) -> list[int]:
        """One token per row of float32 `logits` [requests, vocab]: `first` marks the rows
        choosing their first token."""
        logits[:, self.suppress] = -torch.inf
        first_rows = torch.tensor(first, device=self.device)
        if self.begin_suppress.numel() and bool(first_rows.any()):
            rows = logits[first_rows]
            rows[:, self.begin_suppress] = -torch.inf
            logits[first_rows] = rows
        tokens = logits.argmax(dim=-1).tolist()
        for i, temperature in enumerate(temperatures):
            if temperature > 0.0:
                probs = torch.softmax(logits[i] / temperature, dim=-1)
                tokens[i] = int(torch.multinomial(probs, 1, generator=self.generator))
        return tokens

    def _stop_reason(self, r: TranscriptionRequest, token: int) -> str | None:
        if token == self.model.config.eos_token_id:
            return "stop"
        at_end = len(r.prompt) + len(r.output) >= self.model.config.max_target_positions
        return "length" if len(r.output) >= r.max_tokens or at_end else None

    def _finish(self, r: TranscriptionRequest, reason: str) -> None:
        # Both groups at once, the last blocks first (the pool's free-list convention).
        self.pool.free(reversed(r.cross_blocks + r.self_blocks))
        r.cross_blocks, r.self_blocks = [], []
        r.finish_reason = reason

    def run(self) -> list[TranscriptionRequest]:
        """Step until every request has finished; in order of finishing."""
        done = []
        while self.has_unfinished:
            done += self.step()
        return done
