"""The engine's view of its frontends: silence counts only while the engine runs."""

from __future__ import annotations

from engine_core.liveness import PAUSED_S, TICK_S, FrontendLiveness


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_for(live: FrontendLiveness, clock: Clock, seconds: float,
            pinging: tuple[bytes, ...] = ()) -> None:
    """`seconds` of a running engine: the I/O thread ticking, `pinging` frontends pinging."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now += TICK_S
        live.tick()
        for ident in pinging:
            live.heard(ident, ping=True)


def test_a_frontend_silent_past_the_timeout_is_lost_once() -> None:
    clock = Clock()
    live = FrontendLiveness(timeout_s=5.0, clock=clock)
    live.heard(b"a", ping=True)
    live.heard(b"b", ping=True)
    live.heard(b"tool", ping=False)  # never pinged: never judged
    run_for(live, clock, 4.0, pinging=(b"b",))
    assert live.lost() == []
    run_for(live, clock, 1.5, pinging=(b"b",))
    assert live.lost() == [b"a"]
    assert live.lost() == []  # forgotten once returned
    run_for(live, clock, 30.0)
    assert live.lost() == [b"b"]


def test_a_paused_engine_does_not_take_its_live_frontends_for_lost() -> None:
    """SIGSTOP for 8 s: no ping could be read meanwhile. Resumed, the busy loop may look before
    the I/O thread has read the pings waiting in the socket: nobody is judged until it ticked,
    and the pause is not counted as anyone's silence."""
    clock = Clock()
    live = FrontendLiveness(timeout_s=5.0, clock=clock)
    live.heard(b"a", ping=True)
    live.heard(b"dead", ping=True)
    run_for(live, clock, 3.0, pinging=(b"a",))
    clock.now += 8.0  # the whole process stopped
    assert live.lost() == []  # the busy loop first: the I/O thread has not ticked yet
    live.tick()  # the I/O thread: the gap is nobody's silence
    assert live.lost() == []
    live.heard(b"a", ping=True)  # the waiting pings
    run_for(live, clock, 1.5, pinging=(b"a",))
    assert live.lost() == []  # "dead" has been silent 3 + 1.5 s of running time
    run_for(live, clock, 1.0, pinging=(b"a",))
    assert live.lost() == [b"dead"]


def test_without_the_tick_a_pause_would_lose_everyone() -> None:
    """The failure the tick prevents (the soak's engine pause of 5 s aborted 17 live
    requests): with ticks right up to the look, the same wall-clock gap does count."""
    clock = Clock()
    live = FrontendLiveness(timeout_s=5.0, clock=clock)
    live.heard(b"a", ping=True)
    clock.now += PAUSED_S / 2
    live.tick()
    run_for(live, clock, 6.0)  # running, and "a" silent
    assert live.lost() == [b"a"]
