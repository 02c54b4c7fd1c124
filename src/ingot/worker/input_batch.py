"""The runner's persistent input batch: what it keeps about its requests between steps, in
tensors that steps index instead of rebuilding.

A request takes a row when it first arrives and keeps it until it finishes (rows are reused).
The block table holds each row's block ids, extended in place as the scheduler hands out new
blocks, so a step's table is one gather of its requests' rows; the runner holds no other copy of
the block ids. The sampling metadata of a decode batch is kept while the batch's requests (and
their order) stay the same: its per-row tensors (temperature, penalties, the padded prompt that
penalties read) depend only on the requests, and the output-token lists it reads are the
requests' own, extended in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ingot.model_executor.layers.sampler import SamplingMetadata
from ingot.sched_output import NULL_BLOCK_ID


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        """Rows for ``max_num_reqs`` requests of up to ``max_blocks_per_req`` blocks; both grow
        when a step needs more (a preempted request may still hold its row while others run)."""
        self.block_table = torch.full((max(1, max_num_reqs), max(1, max_blocks_per_req)),
                                      NULL_BLOCK_ID, dtype=torch.int64)
        self.num_blocks = torch.zeros(self.block_table.shape[0], dtype=torch.int64)
        self.row_of: dict[str, int] = {}
        self._free = list(range(self.block_table.shape[0] - 1, -1, -1))
        self._sampling: tuple[tuple[str, ...], SamplingMetadata] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    def add(self, req_id: str) -> int:
        if req_id in self.row_of:
            raise ValueError(f"request {req_id!r} already has a row in the input batch")
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self.row_of[req_id] = row
        return row

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.block_table[row, : int(self.num_blocks[row])] = NULL_BLOCK_ID
        self.num_blocks[row] = 0
        self._free.append(row)
        if self._sampling is not None and req_id in self._sampling[0]:
            self._sampling = None

    def clear(self) -> None:
        for req_id in list(self.row_of):
            self.remove(req_id)
        self._sampling = None

    def append_block_ids(self, req_id: str, block_ids: list[int]) -> None:
        row = self.row_of[req_id]
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.block_table.shape[1]:
            self._grow_blocks(end)
        self.block_table[row, start:end] = torch.tensor(block_ids, dtype=torch.int64)
        self.num_blocks[row] = end

    def block_ids(self, req_id: str) -> list[int]:
        row = self.row_of[req_id]
        return self.block_table[row, : int(self.num_blocks[row])].tolist()

    def rows(self, req_ids: list[str]) -> torch.Tensor:
        return torch.tensor([self.row_of[r] for r in req_ids], dtype=torch.int64)

    def max_num_blocks(self, rows: torch.Tensor) -> int:
        return int(self.num_blocks.index_select(0, rows).max()) if rows.numel() else 0

    def table(self, rows: torch.Tensor, num_rows: int, width: int) -> torch.Tensor:
        """[num_rows, width] block ids: ``rows``' blocks (null past each request's last
        block), then null rows up to ``num_rows`` (a padded batch's dummy rows)."""
        out = torch.full((num_rows, width), NULL_BLOCK_ID, dtype=torch.int64)
        cols = min(width, self.block_table.shape[1])
        out[: rows.numel(), :cols] = self.block_table.index_select(0, rows)[:, :cols]
        return out

    def sampling_metadata(
        self, req_ids: list[str], build: Callable[[], SamplingMetadata]
    ) -> SamplingMetadata:
        """The metadata for these requests in this order: the kept one when the previous call
        had the same requests, else ``build()``'s (kept for the next call)."""
        key = tuple(req_ids)
        if self._sampling is not None and self._sampling[0] == key:
            metadata = self._sampling[1]
            # Rows that reached their min_tokens no longer mask stop tokens (and a batch with
            # none left can take the plain argmax again).
            metadata.min_tokens = {row: v for row, v in metadata.min_tokens.items()
                                   if len(metadata.output_token_ids[row]) < v[0]}
            return metadata
        metadata = build()
        self._sampling = (key, metadata)
        return metadata

    def _grow_rows(self) -> None:
        old = self.block_table.shape[0]
        self.block_table = torch.cat([self.block_table, torch.full_like(self.block_table,
                                                                        NULL_BLOCK_ID)])
        self.num_blocks = torch.cat([self.num_blocks, torch.zeros_like(self.num_blocks)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _grow_blocks(self, needed: int) -> None:
        width = max(needed, 2 * self.block_table.shape[1])
        grown = torch.full((self.block_table.shape[0], width), NULL_BLOCK_ID, dtype=torch.int64)
        grown[:, : self.block_table.shape[1]] = self.block_table
        self.block_table = grown
