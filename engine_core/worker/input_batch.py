"""A step's inputs, built from state kept across steps: the persistent block table.

Each running request owns a row of one block table, kept on the host (numpy) and on the device
(int32) for as long as it runs. A step writes only what changed: the rows of requests new to
it, and the blocks appended since the last step (a decode adds one every `block_size` steps),
in one upload and one indexed write on the device. The decode kernel reads the device table in
place, so no step uploads a block table, and its width (the model's context in blocks) never
changes: the kernel is specialized once.

The row also keeps the newest token of its request that the step's inputs need: a decode's
input is the token its request sampled last, recorded here when the step that sampled it is
recorded (`note_sampled`), so a decode-only step's token ids are one gather, not a loop over
the requests. With overlapped steps that token may still be on the device, a placeholder
(`note_placeholders`): the step's inputs then say where, in the previous step's sampled
tokens, each such row's token is (`StepInputs.pending_rows`, `pending_src`), and the device
copies it there. A row that changed hands since (its request preempted or finished, the row
given to another) is told apart by its epoch and never written by a late record.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine_core.layers.host_link import HostLink
from engine_core.sched.request import Request, Status
from engine_core.sched.scheduler import SchedulerOutput


class StepRows(NamedTuple):
    """Where a step's requests are: their rows (and the rows' epochs then), and of the
    requests that sample, their rows and the position of the token they sample."""

    rows: np.ndarray  # int64 [B]
    epochs: np.ndarray  # int64 [B]
    sampler_rows: np.ndarray  # int64 [S]
    sampler_epochs: np.ndarray  # int64 [S]
    sampler_positions: np.ndarray  # int64 [S]


class StepInputs(NamedTuple):
    """One step's inputs on the host."""

    starts: np.ndarray  # int64 [B] first position computed
    num_new: np.ndarray  # int64 [B] tokens computed
    token_ids: np.ndarray  # int64 [T] (PLACEHOLDER where `pending_rows` says)
    pending_rows: np.ndarray  # int64 packed rows whose token is on the device
    pending_src: np.ndarray  # int64 their rows in the previous step's sampled tokens
    rows: StepRows

    @property
    def decode_only(self) -> bool:
        return bool(len(self.num_new)) and int(self.num_new.max()) == 1


class BlockTables:
    """The persistent block table: `rows` request rows and, last, a dummy row whose every
    entry is `dummy_block` (padded rows of a CUDA graph read it)."""

    def __init__(self, rows: int, width: int, block_size: int, device: torch.device,
                 link: HostLink, dummy_block: int = 0) -> None:
        self.block_size = block_size
        self.width = width
        self.dummy_row = rows
        self.link = link
        self.host = np.zeros((rows + 1, width), dtype=np.int32)
        self.host[rows] = dummy_block
        self.device = link.upload(self.host)  # [rows + 1, width], allocated whole
        self._shared = self.device.device.type == "cpu" and \
            self.device.data_ptr() == self.host.ctypes.data
        self.count = np.zeros(rows + 1, dtype=np.int64)  # blocks written per row
        self.epoch = np.zeros(rows + 1, dtype=np.int64)  # bumped when a row changes hands
        self.last_token = np.full(rows + 1, -1, dtype=np.int64)  # the newest known token
        self.last_pos = np.full(rows + 1, -1, dtype=np.int64)  # ... and its position
        self.pending = np.full(rows + 1, -1, dtype=np.int64)  # placeholder: row in samples
        self.row_of: dict[Request, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    # -- rows -------------------------------------------------------------------------------
    def rows_for(self, reqs: Sequence[Request]) -> np.ndarray:
        """Each request's row, given one if it has none."""
        rows = np.fromiter(map(self.row_of.get, reqs, itertools.repeat(-1)), np.int64,
                           len(reqs))
        for i in np.nonzero(rows < 0)[0]:
            rows[i] = self._assign(reqs[int(i)])
        return rows

    def _assign(self, req: Request) -> int:
        if not self._free:
            self._reclaim()
        row = self._free.pop()
        self.row_of[req] = row
        self.count[row] = 0
        self.epoch[row] += 1
        self.last_pos[row] = self.pending[row] = -1
        return row

    def _reclaim(self) -> None:
        """Rows of finished requests back to the free list (done when it runs out)."""
        self.release([r for r in self.row_of if r.status is Status.FINISHED])
        if not self._free:
            raise RuntimeError("more requests running than the block table has rows")

    def release(self, reqs: Sequence[Request]) -> None:
        """These requests' rows are free (preempted: their blocks are gone)."""
        for req in reqs:
            row = self.row_of.pop(req, None)
            if row is not None:
                self._free.append(row)
                self.epoch[row] += 1

    # -- the table --------------------------------------------------------------------------
    def sync(self, reqs: Sequence[Request], rows: np.ndarray, ends: np.ndarray) -> None:
        """Write the blocks each row lacks to hold positions below `ends` (host and device)."""
        need = -(-ends // self.block_size)
        have = self.count[rows]
        grow = np.flatnonzero(need > have)
        if not len(grow):
            return
        at_rows, at_cols, need, have = rows[grow], have[grow], need[grow], have[grow]
        if bool((need - have == 1).all()):  # a block more each (decodes): no loop over rows
            blocks = np.fromiter([reqs[i].block_ids[h] for i, h in
                                  zip(grow.tolist(), have.tolist())], np.int64, len(grow))
        else:
            at_rows = np.repeat(at_rows, need - have)
            at_cols = np.concatenate([np.arange(h, n) for h, n in
                                      zip(have.tolist(), need.tolist())])
            blocks = np.fromiter(itertools.chain.from_iterable(
                [reqs[i].block_ids[h:n] for i, h, n in
                 zip(grow.tolist(), have.tolist(), need.tolist())]), np.int64, len(at_cols))
        self.host[at_rows, at_cols] = blocks
        self.count[rows[grow]] = need
        if not self._shared:  # (on the CPU the device table is the host's memory)
            r, c, b = self.link.upload_many([at_rows, at_cols, blocks], np.int64)
            self.device.index_put_((r, c), b.to(torch.int32))

    def write_rows(self, table: np.ndarray) -> np.ndarray:
        """A tensor-parallel worker's table (it keeps no request): rows 0..B-1 hold `table`
        [B, width], rank 0's rows of a step's B sequences, on the host and the device; their
        row ids. Columns past `width` keep stale blocks no attention reads (each sequence reads
        its blocks below its context length)."""
        rows, width = table.shape
        assert rows <= self.dummy_row, "more sequences in a step than the table has rows"
        self.host[:rows, :width] = table
        if not self._shared:
            self.device[:rows, :width].copy_(self.link.upload(self.host[:rows, :width]))
        return np.arange(rows, dtype=np.int64)

    def rows_view(self, rows: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The host table's `rows`, as wide as the longest needs."""
        width = max(1, -(-int(ends.max()) // self.block_size)) if len(ends) else 1
        return self.host[rows, :width]

    # -- the step's inputs ------------------------------------------------------------------
    def inputs(self, sched: SchedulerOutput) -> StepInputs:
        """The step's inputs; the rows' tables written first (`sync`)."""
        reqs = sched.requests
        starts, num_new, samples = sched.columns()
        rows = self.rows_for(reqs)
        self.sync(reqs, rows, starts + num_new)
        tokens, pending_rows, pending_src = self._token_ids(sched, rows, starts, num_new)
        sampler_rows = rows[samples]
        step_rows = StepRows(rows, self.epoch[rows], sampler_rows, self.epoch[sampler_rows],
                             (starts + num_new)[samples])
        return StepInputs(starts, num_new, tokens, pending_rows, pending_src, step_rows)

    def _token_ids(self, sched: SchedulerOutput, rows: np.ndarray, starts: np.ndarray,
                   num_new: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decodes of the token their row recorded: one gather; every other row's tokens
        from its request (prefill chunks)."""
        known = (num_new == 1) & (self.last_pos[rows] == starts)
        offsets = np.cumsum(num_new) - num_new
        if bool(known.all()):
            tokens = self.last_token[rows]
        else:
            tokens = np.empty(int(num_new.sum()), dtype=np.int64)
            tokens[offsets[known]] = self.last_token[rows[known]]
            for i in np.nonzero(~known)[0].tolist():
                start, n, at = sched.starts[i], sched.num_new[i], int(offsets[i])
                ids = sched.requests[i].all_token_ids[start:start + n]
                tokens[at:at + len(ids)] = ids
                if len(ids) < n:  # its last token, then the drafts it verifies
                    tokens[at + len(ids):at + n] = sched.special[i].drafts
        src = self.pending[rows]
        waiting = known & (src >= 0)
        return tokens, offsets[waiting], src[waiting]

    def note_sampled(self, step: StepRows, tokens: np.ndarray,
                     shift: np.ndarray | None = None) -> None:
        """The tokens a step sampled, one per `step.sampler_rows`, known on the host (each
        `shift` positions from the step's last plus one: see ModelRunner.note_sampled)."""
        ok = self.epoch[step.sampler_rows] == step.sampler_epochs
        rows = step.sampler_rows[ok]
        self.last_token[rows] = np.asarray(tokens, dtype=np.int64)[ok]
        positions = step.sampler_positions if shift is None else step.sampler_positions + shift
        self.last_pos[rows] = positions[ok]
        self.pending[rows] = -1

    def note_placeholders(self, step: StepRows) -> None:
        """A step's sampled tokens are still on the device (an overlapped step): the next
        step's inputs take them from there, row i of the samples for sampler i."""
        rows = step.sampler_rows
        self.last_token[rows] = -1
        self.last_pos[rows] = step.sampler_positions
        self.pending[rows] = np.arange(len(rows))
