"""What the engine's I/O thread knows about liveness, both ways.

`LoopProgress`: the busy loop's own heartbeat. The I/O thread answers pings without waiting for
a step (so a long step does not look like a dead engine), which also means a live socket
proves nothing about the work: a hung kernel or a deadlock in the loop would look healthy. The
loop records when it last made progress; the ping answer carries it (`StepProgress`) and the
frontends and the launcher judge it (`shared.transport.is_stalled`).

`FrontendLiveness`: when each frontend was last heard. A frontend pings every quarter second;
one silent for `timeout_s` is gone (killed, crashed, partitioned), and nobody will read its
requests' outputs: the busy loop aborts them instead of computing them to the end. Only
identities that have pinged are judged, so a client that never pings (a test, a tool) is never
taken for dead.

Both count only time this process could run (`RunningClock`): the I/O thread ticks a few times
a second, and a gap between its ticks (the whole engine stopped: SIGSTOP, a cgroup freezer or
`docker pause`, a VM frozen or migrated, heavy swapping, a debugger) is nobody's doing. It is
left out of every frontend's silence, since no ping could have been read meanwhile (without
that, an engine resumed after a 5 s pause aborted the requests of every live frontend), and out
of the loop's time without a step (without that, the first ping answered after a 10 s pause
said "no step for 10 s", and the launcher killed a healthy engine as stuck). A step loop that is
really stuck keeps the I/O thread ticking, so its time counts whole and it is still caught.

Both are written by one thread and read by another with plain attribute stores and dict copies,
which are atomic under the GIL: no lock on the busy loop's path.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.messages import StepProgress

Clock = Callable[[], float]

TICK_S = 0.25  # the I/O thread's tick (its poll timeout)
PAUSED_S = 1.0  # a gap between ticks this long: the process was stopped or starved


class RunningClock:
    """Seconds this process could run: a monotonic clock less every gap of more than PAUSED_S
    between the I/O thread's ticks. A gap still open (resumed, the I/O thread not yet ticked)
    is left out already, so whichever thread reads first after a pause, the clock never jumps
    and never goes back."""

    def __init__(self, wall: Clock = time.monotonic) -> None:
        self._wall = wall
        # (last tick, seconds paused before it): one tuple, so a reader on another thread sees
        # both from the same tick
        self._state = (wall(), 0.0)

    def tick(self) -> None:
        """The I/O thread is running (it calls this at least every TICK_S)."""
        now = self._wall()
        last_tick, paused = self._state
        gap = now - last_tick
        self._state = (now, paused + gap if gap > PAUSED_S else paused)

    def __call__(self) -> float:
        now = self._wall()
        last_tick, paused = self._state
        return (last_tick if now - last_tick > PAUSED_S else now) - paused

    @property
    def ticking(self) -> bool:
        """No gap is open: the I/O thread has ticked within PAUSED_S."""
        return self._wall() - self._state[0] <= PAUSED_S


class LoopProgress:
    """The busy loop calls `waiting()`, `took_input()`, `step_started()`, `step_finished()`;
    the I/O thread calls `snapshot()`. Times are the process's running time (`RunningClock`)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._busy = False
        self._last_progress = clock()
        self._step_start: float | None = None
        self._slowest = 0.0

    def waiting(self) -> None:
        """About to block for input: nothing is owed until some arrives."""
        self._busy = False

    def took_input(self) -> None:
        self._busy = True
        self._last_progress = self._clock()

    def step_started(self) -> None:
        self._busy = True
        self._step_start = self._clock()

    def step_finished(self) -> None:
        now = self._clock()
        if self._step_start is not None:
            self._slowest = max(self._slowest, now - self._step_start)
        self._step_start = None
        self._last_progress = now

    def snapshot(self) -> StepProgress:
        since = max(0.0, self._clock() - self._last_progress) if self._busy else 0.0
        return StepProgress(busy=self._busy, since_step_s=since, slowest_step_s=self._slowest)


class FrontendLiveness:
    """Last-heard times per frontend identity (those that ping), and who went silent."""

    def __init__(self, clock: RunningClock, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._heard: dict[bytes, float] = {}

    def heard(self, identity: bytes, ping: bool) -> None:
        """A frame from `identity` (I/O thread); a ping makes it one that is judged."""
        if ping or identity in self._heard:
            self._heard[identity] = self._clock()

    def lost(self) -> list[bytes]:
        """Identities silent for longer than the timeout; forgotten once returned (busy loop).
        Nobody while a gap is open (the I/O thread has pings to read first)."""
        if not self._clock.ticking:
            return []
        now = self._clock()
        gone = [ident for ident, t in self._heard.copy().items() if now - t > self.timeout_s]
        for ident in gone:
            self._heard.pop(ident, None)
        return gone
