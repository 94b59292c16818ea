"""Liveness inside the engine, both ways: silence and time without a step count only while the
engine runs (a pause of the whole process is nobody's doing)."""

from __future__ import annotations

from engine_core.liveness import PAUSED_S, TICK_S, FrontendLiveness, LoopProgress, RunningClock
from shared.transport import DEFAULT_STALL_FLOOR_S, is_stalled


class Wall:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_for(running: RunningClock, wall: Wall, seconds: float,
            live: FrontendLiveness | None = None, pinging: tuple[bytes, ...] = ()) -> None:
    """`seconds` of a running engine: the I/O thread ticking, `pinging` frontends pinging."""
    end = wall.now + seconds
    while wall.now < end:
        wall.now += TICK_S
        running.tick()
        for ident in pinging:
            assert live is not None
            live.heard(ident, ping=True)


def frontends(timeout_s: float = 5.0) -> tuple[FrontendLiveness, RunningClock, Wall]:
    wall = Wall()
    running = RunningClock(wall)
    return FrontendLiveness(running, timeout_s), running, wall


def test_a_frontend_silent_past_the_timeout_is_lost_once() -> None:
    live, running, wall = frontends()
    live.heard(b"a", ping=True)
    live.heard(b"b", ping=True)
    live.heard(b"tool", ping=False)  # never pinged: never judged
    run_for(running, wall, 4.0, live, pinging=(b"b",))
    assert live.lost() == []
    run_for(running, wall, 1.5, live, pinging=(b"b",))
    assert live.lost() == [b"a"]
    assert live.lost() == []  # forgotten once returned
    run_for(running, wall, 30.0)
    assert live.lost() == [b"b"]


def test_a_paused_engine_does_not_take_its_live_frontends_for_lost() -> None:
    """SIGSTOP for 8 s: no ping could be read meanwhile. Resumed, the busy loop may look before
    the I/O thread has read the pings waiting in the socket: nobody is judged until it ticked,
    and the pause is not counted as anyone's silence."""
    live, running, wall = frontends()
    live.heard(b"a", ping=True)
    live.heard(b"dead", ping=True)
    run_for(running, wall, 3.0, live, pinging=(b"a",))
    wall.now += 8.0  # the whole process stopped
    assert live.lost() == []  # the busy loop first: the I/O thread has not ticked yet
    running.tick()  # the I/O thread: the gap is nobody's silence
    assert live.lost() == []
    live.heard(b"a", ping=True)  # the waiting pings
    run_for(running, wall, 1.5, live, pinging=(b"a",))
    assert live.lost() == []  # "dead" has been silent 3 + 1.5 s of running time
    run_for(running, wall, 1.0, live, pinging=(b"a",))
    assert live.lost() == [b"dead"]


def test_without_the_tick_a_pause_would_lose_everyone() -> None:
    """The failure the tick prevents (the soak's engine pause of 5 s aborted 17 live
    requests): with ticks right up to the look, the same wall-clock gap does count."""
    live, running, wall = frontends()
    live.heard(b"a", ping=True)
    wall.now += PAUSED_S / 2
    running.tick()
    run_for(running, wall, 6.0)  # running, and "a" silent
    assert live.lost() == [b"a"]


def step_loop() -> tuple[LoopProgress, RunningClock, Wall]:
    wall = Wall()
    running = RunningClock(wall)
    return LoopProgress(running), running, wall


def test_a_paused_step_loop_is_not_judged_stuck_on_resume() -> None:
    """SIGSTOP for 15 s in the middle of a step, with work waiting (the launcher killed such an
    engine as stuck): the pause is left out of the time without a step, whether a ping is
    answered before the I/O thread's first tick after it or after, and out of the step's
    length."""
    progress, running, wall = step_loop()
    progress.took_input()
    run_for(running, wall, 2.0)
    progress.step_started()
    run_for(running, wall, 0.5)
    wall.now += 15.0  # the whole process stopped
    before_tick = progress.snapshot()
    running.tick()
    after_tick = progress.snapshot()
    for snap in (before_tick, after_tick):
        assert snap.busy and snap.since_step_s < 3.0, snap
        assert not is_stalled(snap)
    run_for(running, wall, 0.25)
    progress.step_finished()
    assert progress.snapshot().slowest_step_s < 1.0


def test_a_stuck_step_loop_is_still_caught_within_its_bound() -> None:
    """A loop blocked for 20 s while its I/O thread ticks: all of it counts."""
    progress, running, wall = step_loop()
    progress.took_input()
    progress.step_started()
    run_for(running, wall, DEFAULT_STALL_FLOOR_S - 1.0)
    assert not is_stalled(progress.snapshot())
    run_for(running, wall, 2.0)
    snap = progress.snapshot()
    assert is_stalled(snap) and snap.since_step_s > DEFAULT_STALL_FLOOR_S
    run_for(running, wall, 9.0)
    assert progress.snapshot().since_step_s >= 20.0


def test_the_running_clock_never_jumps_nor_goes_back_across_a_pause() -> None:
    wall = Wall()
    running = RunningClock(wall)
    run_for(running, wall, 1.0)
    before = running()
    wall.now += 30.0
    during = running()  # resumed, not yet ticked
    running.tick()
    after = running()
    assert before <= during <= after <= before + TICK_S + 1e-9
    run_for(running, wall, 2.0)
    assert running() - after == 2.0
