"""The runner's persistent batch: every running request's tokens and block table, kept between
steps in preallocated numpy arrays, one row per request.

The scheduler sends a request in full once and then only increments (scheduler/outputs.py);
`InputBatch.apply` folds them in, and `InputBatch.prepare` turns one step into flat index arrays
with a handful of vectorised numpy operations whatever the batch size or context length: no
per-request copy of a block table or token list on the hot path.

    row r:  token_ids[r, :num_known[r]]   ids known on the host (prompt, then outputs)
            num_tokens[r]                 num_known[r] + tokens still being sampled (0 or 1)
            block_table[r, :num_blocks[r]]  interleaved by KV-cache group, as the scheduler's
                                          tables are: entry i * G + g is block i of group g
            num_computed[r]               where the request's next chunk starts

A step's block tables and slot mappings come out per group ([G, ...]); in a sliding-window
group, the entries before the window (blocks the scheduler gave back) are pointed at the row's
last block, so that no reader ever touches a block that now belongs to someone else.

A token still being sampled (asynchronous scheduling runs the next step before the previous
step's ids are back on the host) is a "placeholder": its id is copied on the device from the
previous step's sampled ids (`Batch.fill_dst` / `fill_src`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedserve.scheduler import LoRARequest, SamplingParams, SchedulerOutput
from pagedserve.scheduler.outputs import NewRequestData


@dataclass(frozen=True)
class Batch:
    """One step's flattened inputs, on the host (numpy)."""

    request_ids: list[str]  # batch order
    rows: np.ndarray  # [num_seqs] row of each sequence
    input_ids: np.ndarray  # [num_tokens] int64 (placeholders hold 0 until filled)
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_groups, num_tokens] int64
    block_tables: np.ndarray  # [num_groups, num_seqs, width] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    sample: np.ndarray  # [num_seqs] bool: the sequence samples a token this step
    ends: np.ndarray  # [num_seqs] position after the chunk (= the sampled token's position)
    # [num_seqs] draft tokens at the end of each sequence's chunk (speculative decoding): a
    # sequence with d drafts samples at its last d + 1 positions, and its first sampled token
    # lands at ends - d.
    num_drafts: np.ndarray
    # Placeholder tokens: input_ids[fill_dst[i]] = previous step's sampled ids[fill_src[i]].
    fill_dst: np.ndarray
    fill_src: np.ndarray
    # Prompt logprobs: (sequence index, target prompt token ids) per asking sequence.
    prompt_logprob_targets: list[tuple[int, np.ndarray]]

    @property
    def sample_indices(self) -> np.ndarray:
        return np.flatnonzero(self.sample)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_seq: int,
        windows: tuple[int | None, ...] = (None,),
    ) -> None:
        self.max_num_reqs = max_num_reqs
        # Each KV-cache group's window (None: full attention).
        self.windows = windows
        self.num_groups = len(windows)
        # One column past max_model_len: a request's last sampled token lands there. np.zeros
        # maps untouched pages lazily, so a long max_model_len costs only what is used.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_known = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros(
            (max_num_reqs, max_blocks_per_seq * len(windows)), dtype=np.int32
        )
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Bumped whenever a row is (re)assigned, so a late result never lands in a new owner.
        self.serial = np.zeros(max_num_reqs, dtype=np.int64)
        self._next_serial = 0
        # Index of the row's token in the last launched step's sampled ids (-1: none).
        self.last_sample_index = np.full(max_num_reqs, -1, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        # Each row's LoRA adapter (None: the base model), and the rows that have one.
        self.loras: list[LoRARequest | None] = [None] * max_num_reqs
        self.lora_rows: set[int] = set()
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Rows whose sampling reads their token history (penalties), or that score their prompt:
        # kept as sets so that a step of plain requests never loops over params.
        self.history_rows: set[int] = set()
        self.prompt_logprob_rows: set[int] = set()

    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    # ---- increments from the scheduler ---------------------------------------------------------

    def apply(self, out: SchedulerOutput) -> None:
        """Drop finished and preempted requests, add new ones, extend the running ones."""
        for request_id in out.finished_request_ids:
            self._remove(request_id)
        for request_id in out.preempted_request_ids:
            self._remove(request_id)
        for new in out.new_requests:
            self._add(new)
        cached = out.cached_requests
        if cached.request_ids:
            row_of = self.row_of
            rows = [row_of[request_id] for request_id in cached.request_ids]
            for row, block_ids in zip(rows, cached.new_block_ids, strict=True):
                if block_ids:
                    n = self.num_blocks[row]
                    self.block_table[row, n : n + len(block_ids)] = block_ids
                    self.num_blocks[row] = n + len(block_ids)
            self.num_computed[rows] = cached.num_computed_tokens
        # Copy-on-write replaced a shared block of these tables (a new request's block_ids hold
        # the copy already).
        for request_id, index, _, copy in out.block_copies:
            row = self.row_of.get(request_id)
            if row is not None:
                self.block_table[row, index] = copy

    def _add(self, new: NewRequestData) -> None:
        assert new.request_id not in self.row_of, f"request {new.request_id!r} already has a row"
        row = self._free_rows.pop()
        self.row_of[new.request_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_known[row] = self.num_tokens[row] = n
        self.num_prompt[row] = new.num_prompt_tokens
        self.num_computed[row] = new.num_computed_tokens
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        self._next_serial += 1
        self.serial[row] = self._next_serial
        self.last_sample_index[row] = -1
        params = self.params[row] = new.sampling_params
        if any(params.needs_history):
            self.history_rows.add(row)
        if params.prompt_logprobs is not None:
            self.prompt_logprob_rows.add(row)
        self.loras[row] = new.lora
        if new.lora is not None:
            self.lora_rows.add(row)

    def _remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return  # finished before it was ever scheduled
        self.params[row] = None
        self.loras[row] = None
        self.lora_rows.discard(row)
        self.history_rows.discard(row)
        self.prompt_logprob_rows.discard(row)
        self._free_rows.append(row)

    # ---- one step ------------------------------------------------------------------------------

    def rows_of(self, out: SchedulerOutput) -> np.ndarray:
        """The rows of the step's sequences, in batch order (after `apply`)."""
        row_of = self.row_of
        return np.fromiter(
            (row_of[request_id] for request_id in out.num_scheduled_tokens),
            np.int64,
            len(out.num_scheduled_tokens),
        )

    def prepare(self, out: SchedulerOutput, rows: np.ndarray, block_size: int) -> Batch:
        """Flatten the step (after `apply`) and advance the rows' progress.

        seq i: positions start_i .. end_i - 1 with start_i = num_computed[row_i]
        query_start_loc = cumsum([0, len_0, len_1, ...]); seq_lens_i = end_i
        slot(token) = block_table[row][pos // block_size] * block_size + pos % block_size
        """
        num_seqs = len(rows)
        q_lens = np.fromiter(out.num_scheduled_tokens.values(), np.int64, num_seqs)
        starts = self.num_computed[rows]
        ends = starts + q_lens
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        groups = self.num_groups
        width = int(self.num_blocks[rows].max()) // groups
        # [num_groups, num_seqs, width]: each group's table, from the interleaved entries.
        block_tables = self.block_table[rows, : width * groups].reshape(num_seqs, width, groups)
        block_tables = np.ascontiguousarray(block_tables.transpose(2, 0, 1))
        if num_tokens == num_seqs:  # decode: one token per sequence
            positions = starts
            token_rows = rows
            seq_idx = np.arange(num_seqs)
        else:
            seq_idx = np.repeat(np.arange(num_seqs), q_lens)
            positions = starts[seq_idx] + (np.arange(num_tokens) - query_start_loc[seq_idx])
            token_rows = rows[seq_idx]
        pos_blocks = block_tables[:, seq_idx, positions // block_size]  # [num_groups, num_tokens]
        for g, window in enumerate(self.windows):
            if window is not None:
                # The entries before the first one the chunk reads: blocks given back.
                first_live = np.maximum(starts - window + 1, 0) // block_size
                last = block_tables[g, np.arange(num_seqs), (ends - 1) // block_size]
                dead = np.arange(width)[None, :] < first_live[:, None]
                block_tables[g] = np.where(dead, last[:, None], block_tables[g])
        num_drafts = np.zeros(num_seqs, dtype=np.int64)
        if out.spec_token_ids:  # (never a decode step: a sequence with drafts has > 1 token)
            # The drafts go after the known tokens; `accept` overwrites them with what the
            # model picked.
            index_of = {request_id: i for i, request_id in enumerate(out.num_scheduled_tokens)}
            for request_id, drafts in out.spec_token_ids.items():
                i = index_of[request_id]
                row = int(rows[i])
                known = int(self.num_known[row])
                self.token_ids[row, known : known + len(drafts)] = drafts
                num_drafts[i] = len(drafts)
            known_end = self.num_known[token_rows] + num_drafts[seq_idx]
        else:
            known_end = self.num_known[token_rows]
        input_ids = self.token_ids[token_rows, positions]
        missing = positions >= known_end
        if missing.any():
            fill_dst = np.flatnonzero(missing)
            fill_src = self.last_sample_index[token_rows[fill_dst]]
            assert (fill_src >= 0).all(), "a placeholder token that no step is sampling"
        else:
            fill_dst = fill_src = np.empty(0, dtype=np.int64)
        sample = ends == self.num_tokens[rows] + num_drafts

        prompt_targets = []
        if self.prompt_logprob_rows:
            for i, row in enumerate(rows.tolist()):
                if row not in self.prompt_logprob_rows:
                    continue
                num_prompt = int(self.num_prompt[row])
                # Scored until the request has an output (a recompute skips them).
                if self.num_tokens[row] == num_prompt:
                    start, end = int(starts[i]), int(ends[i])
                    targets = self.token_ids[row, start + 1 : min(end, num_prompt - 1) + 1]
                    if len(targets):
                        prompt_targets.append((i, targets.copy()))

        # Advance: the chunk is computed; a sampling sequence gains a placeholder, whose id the
        # device will hold at this step's sample index.
        self.num_computed[rows] = ends
        sampling_rows = rows[sample]
        self.num_tokens[sampling_rows] += 1
        self.last_sample_index[sampling_rows] = np.arange(len(sampling_rows))
        return Batch(
            request_ids=list(out.num_scheduled_tokens),
            rows=rows,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=pos_blocks.astype(np.int64) * block_size + positions % block_size,
            block_tables=block_tables,
            seq_lens=ends.astype(np.int32),
            query_start_loc=query_start_loc.astype(np.int32),
            sample=sample,
            ends=ends,
            fill_dst=fill_dst,
            fill_src=fill_src,
            prompt_logprob_targets=prompt_targets,
            num_drafts=num_drafts,
        )

    def history(self, row: int, end: int) -> tuple[list[int], list[int]]:
        """(prompt ids, output ids before position `end`) of a row."""
        num_prompt = int(self.num_prompt[row])
        return self.token_ids[row, :num_prompt].tolist(), self.token_ids[
            row, num_prompt:end
        ].tolist()

    def record(
        self, rows: np.ndarray, serials: np.ndarray, positions: np.ndarray, token_ids: np.ndarray
    ) -> None:
        """Store sampled ids on the host: token i at `positions[i]` of `rows[i]`, unless the row
        changed owner (serial) or already has it."""
        valid = (self.serial[rows] == serials) & (self.num_known[rows] == positions)
        if not valid.all():
            rows, positions, token_ids = rows[valid], positions[valid], token_ids[valid]
        self.token_ids[rows, positions] = token_ids
        self.num_known[rows] += 1

    def accept(self, row: int, tokens: list[int], num_rejected: int) -> None:
        """After `record` stored a speculative step's first token: its further accepted tokens,
        and its progress taken back past the rejected drafts."""
        known = int(self.num_known[row])
        self.token_ids[row, known : known + len(tokens)] = tokens
        self.num_known[row] += len(tokens)
        self.num_tokens[row] += len(tokens)
        self.num_computed[row] -= num_rejected
