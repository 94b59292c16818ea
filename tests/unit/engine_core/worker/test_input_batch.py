"""The persistent block table: rows given and taken back, only new blocks written (host and
device alike), decode tokens gathered from the rows, placeholders, and late records of a row
that changed hands ignored."""

from __future__ import annotations

import numpy as np
import torch

from engine_core.layers.host_link import HostLink
from engine_core.sched.request import Request, Status
from engine_core.sched.scheduler import Scheduled, SchedulerOutput
from engine_core.worker.input_batch import BlockTables
from shared.messages import SamplingParams

LINK = HostLink(torch.device("cpu"), pinned=False, synchronize=lambda: None)


class CountingTables(BlockTables):
    def __init__(self) -> None:
        super().__init__(rows=3, width=4, block_size=2, device=torch.device("cpu"), link=LINK,
                         dummy_block=9)
        self.device_writes: list[int] = []

    def sync(self, reqs, rows, ends):  # type: ignore[no-untyped-def]
        before = int(self.count.sum())
        super().sync(reqs, rows, ends)
        self.device_writes.append(int(self.count.sum()) - before)


def request(rid: str, prompt: list[int], blocks: list[int]) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=8))
    req.block_ids = blocks
    req.status = Status.RUNNING
    return req


def test_rows_blocks_and_tokens():
    tables = CountingTables()
    a, b = request("a", [5, 6, 7], [4, 1]), request("b", [8], [2])
    first = tables.inputs(SchedulerOutput.of([Scheduled(a, 0, 3), Scheduled(b, 0, 1)]))
    assert first.token_ids.tolist() == [5, 6, 7, 8]
    rows = first.rows.rows
    assert tables.host[rows[0], :2].tolist() == [4, 1] and tables.host[rows[1], :1].tolist() == [2]
    assert torch.equal(tables.device, torch.from_numpy(tables.host))  # the device's copy
    assert tables.host[tables.dummy_row].tolist() == [9] * 4
    tables.note_sampled(first.rows, np.array([70, 80]))
    a.all_token_ids.append(70)
    b.all_token_ids.append(80)
    # a decode each: their tokens from the rows; a's block holds position 3, b needs one more
    b.block_ids.append(3)
    second = tables.inputs(SchedulerOutput.of([Scheduled(a, 3, 1), Scheduled(b, 1, 1)]))
    assert second.token_ids.tolist() == [70, 80]
    assert tables.device_writes == [3, 0]  # b's position 1 is in its first block still
    b.all_token_ids.append(81)
    tables.note_sampled(second.rows, np.array([71, 81]))
    third = tables.inputs(SchedulerOutput.of([Scheduled(b, 2, 1)]))
    assert tables.device_writes[-1] == 1 and tables.host[rows[1], :2].tolist() == [2, 3]
    assert third.token_ids.tolist() == [81]


def test_placeholders_and_rows_that_change_hands():
    tables = CountingTables()
    a = request("a", [5], [4])
    step = tables.inputs(SchedulerOutput.of([Scheduled(a, 0, 1)]))
    tables.note_placeholders(step.rows)  # its token still on the device
    a.all_token_ids.append(-1)
    nxt = tables.inputs(SchedulerOutput.of([Scheduled(a, 1, 1)]))
    assert nxt.pending_rows.tolist() == [0] and nxt.pending_src.tolist() == [0]
    tables.release([a])  # preempted: the row is free, and another request takes it
    c = request("c", [9, 9], [6])
    taken = tables.inputs(SchedulerOutput.of([Scheduled(c, 0, 2)]))
    tables.note_sampled(nxt.rows, np.array([33]))  # a's late record: ignored
    row = taken.rows.rows[0]
    assert row == nxt.rows.rows[0]  # the same row, a new epoch
    assert tables.last_token[row] != 33 and tables.last_pos[row] == -1


def test_finished_requests_rows_come_back_when_they_run_out():
    tables = CountingTables()
    reqs = [request(f"r{i}", [1], [i]) for i in range(3)]
    tables.inputs(SchedulerOutput.of([Scheduled(r, 0, 1) for r in reqs]))
    reqs[1].status = Status.FINISHED
    late = request("late", [2], [7])
    rows = tables.inputs(SchedulerOutput.of([Scheduled(late, 0, 1)])).rows.rows
    assert rows.tolist() == [tables.row_of[late]] and reqs[1] not in tables.row_of
