"""OutputStream: how news reaches a consumer (a waiting get(), or a listener)."""

from __future__ import annotations

import asyncio

from frontend.engine.stream import OutputStream, StepItem
from shared.messages import FinishReason


def item(token: int, finish: FinishReason | None = None) -> StepItem:
    return StepItem(0, token, None, None, finish)


async def test_news_is_told_once_per_notify_however_much_was_put() -> None:
    stream, calls, news = OutputStream(), list[list[StepItem]](), list[OutputStream]()
    stream.open("r")
    stream.listen(lambda: calls.append(stream.take()))
    stream.put("r", item(1), news)
    stream.put("r", item(2), news)
    assert news == [stream] and calls == []  # nothing told before the routing is done
    stream.notify()
    assert [i.token_id for i in calls[0]] == [1, 2]
    await asyncio.sleep(0)
    assert len(calls) == 1  # no call scheduled on the side


async def test_notify_wakes_a_waiting_get() -> None:
    stream, news = OutputStream(), list[OutputStream]()
    stream.open("r")
    stream.listen(lambda: None)  # a waiting get() is woken, the listener is not called
    waiter = asyncio.ensure_future(stream.get())
    await asyncio.sleep(0)
    stream.put("r", item(7, FinishReason.LENGTH), news)
    assert not waiter.done()
    stream.notify()
    assert [i.token_id for i in await waiter] == [7]
    assert stream.ended


async def test_put_without_news_calls_the_listener_in_the_next_round() -> None:
    stream, calls = OutputStream(), list[list[StepItem]]()
    stream.open("r")
    stream.listen(lambda: calls.append(stream.take()))
    stream.put("r", item(1))
    stream.put("r", item(2))
    assert calls == []
    await asyncio.sleep(0)
    assert [[i.token_id for i in batch] for batch in calls] == [[1, 2]]
