"""The step-output columns: what pack_step writes, unpack_step reads back, through the wire."""

from __future__ import annotations

import numpy as np

from shared.messages import Finished, FinishReason, StepOutputs, floats, ints
from shared.step_outputs import Logprobs, TokenLogprob, pack_step, unpack_step
from shared.transport import OutputCodec


def through_the_wire(out: StepOutputs) -> StepOutputs:
    codec = OutputCodec()
    decoded = codec.decode(codec.encode(out))
    assert isinstance(decoded, StepOutputs)
    return decoded


def test_round_trip_of_tokens_logprobs_prompt_logprobs_and_finishes() -> None:
    rng = np.random.default_rng(0)
    top_ids = rng.integers(0, 1000, (4, 3)).astype(np.int32)
    top_vals = -rng.random((4, 3)).astype(np.float32)
    lps = Logprobs(np.float32([-0.5, np.nan, -1.5, -2.5]), np.int32([1, 0, 7, 2]),
                   top_ids, top_vals)
    prompt = Logprobs(np.float32([-1, -2]), np.int32([3, 4]), np.int32([[5], [6]]),
                      np.float32([[-0.1], [-0.2]]))
    out = pack_step(
        ["a", "b", "c", "d"], [11, -1, 13, 14], logprobs=lps, lp_k=[3, -1, 0, 2],
        prompt_logprobs={1: prompt},
        finished=[Finished(2, FinishReason.STOP, stop_token_id=13),
                  Finished(3, FinishReason.LENGTH)])
    rows = unpack_step(through_the_wire(out))
    assert [r.request_id for r in rows] == ["a", "b", "c", "d"]
    a, b, c, d = rows
    assert a.token_id == 11 and a.finish is None and a.prompt_logprobs is None
    assert a.logprob == TokenLogprob(-0.5, 1, top_ids[0].tolist(), top_vals[0].tolist())
    assert b.token_id is None and b.logprob is None
    assert b.prompt_logprobs is not None and len(b.prompt_logprobs) == 2
    assert list(b.prompt_logprobs) == [TokenLogprob(-1.0, 3, [5], [np.float32(-0.1).item()]),
                                       TokenLogprob(-2.0, 4, [6], [np.float32(-0.2).item()])]
    assert b.prompt_logprobs[-1] == b.prompt_logprobs[1] and b.prompt_logprobs[1:] == [
        b.prompt_logprobs[1]]
    assert (b.prompt_logprobs.top_ids, b.prompt_logprobs.k) == ([5, 6], 1)  # the columns
    assert c.logprob == TokenLogprob(-1.5, 7, [], [])
    assert c.finish is not None and (c.finish.reason, c.finish.stop_token_id) == ("stop", 13)
    assert c.finish.reason is FinishReason.STOP
    assert d.logprob == TokenLogprob(-2.5, 2, top_ids[3, :2].tolist(), top_vals[3, :2].tolist())
    assert d.finish is not None and d.finish.reason is FinishReason.LENGTH


def test_rows_without_news_are_left_out_and_no_logprob_columns_are_sent_for_none() -> None:
    out = pack_step(["a", "b"], [-1, 5], logprobs=Logprobs.empty(2).take([]), lp_k=[])
    assert out.lp_k == b""
    rows = unpack_step(through_the_wire(pack_step(["a", "b"], [-1, 5])))
    assert [(r.request_id, r.token_id, r.logprob) for r in rows] == [("b", 5, None)]


def test_columns_written_by_hand_read_as_packed() -> None:
    """The wire layout itself: each row's top-k back to back, lp_k -1 for rows without."""
    out = StepOutputs(["a", "b", "c"], ints([1, 2, 3]), lp_k=ints([2, -1, 0]),
                      lp_sampled=floats([-1, 0, -3]), lp_rank=ints([1, 0, 4]),
                      lp_top_ids=ints([1, 7]), lp_top_vals=floats([-1, -2]))
    a, b, c = unpack_step(out)
    assert a.logprob == TokenLogprob(-1.0, 1, [1, 7], [-1.0, -2.0])
    assert b.logprob is None and c.logprob == TokenLogprob(-3.0, 4, [], [])
    lps = Logprobs(np.float32([-1, 0, -3]), np.int32([1, 0, 4]), np.int32([[1, 7], [0, 0], [0, 0]]),
                   np.float32([[-1, -2], [0, 0], [0, 0]]))
    packed = pack_step(["a", "b", "c"], [1, 2, 3], logprobs=lps, lp_k=[2, -1, 0])
    assert (packed.lp_k, packed.lp_top_ids, packed.lp_top_vals) == (
        out.lp_k, out.lp_top_ids, out.lp_top_vals)


def test_rows_with_one_top_k_read_as_rows_with_mixed_ones() -> None:
    """The common step (every row asked the same k) takes a shortcut: same rows."""
    ids, vals = list(range(6)), [-0.5 * i for i in range(6)]
    same = StepOutputs(["a", "b", "c"], ints([1, 2, 3]), lp_k=ints([2, 2, 2]),
                       lp_sampled=floats([-1, -2, -3]), lp_rank=ints([1, 2, 3]),
                       lp_top_ids=ints(ids), lp_top_vals=floats(vals))
    assert [r.logprob for r in unpack_step(same)] == [
        TokenLogprob(-1.0 - i, 1 + i, ids[2 * i:2 * i + 2], vals[2 * i:2 * i + 2])
        for i in range(3)]
    zero = StepOutputs(["a", "b"], ints([1, 2]), lp_k=ints([0, 0]), lp_sampled=floats([-1, -2]),
                       lp_rank=ints([1, 2]))
    assert [r.logprob for r in unpack_step(zero)] == [TokenLogprob(-1.0, 1, [], []),
                                                      TokenLogprob(-2.0, 2, [], [])]


def test_logprobs_take_and_concat() -> None:
    lps = Logprobs(np.float32([1, 2, 3]), np.int32([1, 2, 3]), np.arange(9).reshape(3, 3),
                   np.zeros((3, 3), np.float32))
    two = lps.take([2, 0], k=1)
    assert two.logprobs.tolist() == [3, 1] and two.top_ids.tolist() == [[6], [0]]
    both = Logprobs.concat([two, two])
    assert len(both) == 4 and both.top_ids.shape == (4, 1)
    assert Logprobs.concat([], k=2).top_ids.shape == (0, 2)
