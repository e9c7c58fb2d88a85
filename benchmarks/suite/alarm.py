"""A section's deadline as SIGALRM: the suite ends inside its budget even if a section hangs."""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import Any

REPEAT_S = 0.5  # after the deadline, the alarm fires again this often until the section ends


class SectionTimeout(BaseException):
    """Raised by the alarm when a section overruns the suite's budget (a BaseException, so
    that a section's own `except Exception` cannot swallow it)."""


@dataclasses.dataclass(slots=True)
class Alarm:
    """`with Alarm(seconds):` raises SectionTimeout in the main thread when time is up.

    `fired` survives library code that catches every exception (a swallowed SectionTimeout
    still marks the section overrun), and the alarm repeats every REPEAT_S until the section
    ends: a timeout raised where Python cannot propagate it (a weakref or GC callback prints it
    as "unraisable" and goes on) is raised again. A timer armed before (pytest-timeout's, in
    tests) is re-armed afterwards with what was left of it.
    """

    seconds: float
    fired: bool = False
    _started: float = dataclasses.field(default=0.0, init=False)
    _previous_handler: Any = dataclasses.field(default=None, init=False)
    _previous_timer_s: float = dataclasses.field(default=0.0, init=False)

    def _on_alarm(self, signum: int, frame: object) -> None:
        self.fired = True
        raise SectionTimeout("the suite's time budget ran out during this section")

    def __enter__(self) -> Alarm:
        self._started = time.perf_counter()
        self._previous_handler = signal.signal(signal.SIGALRM, self._on_alarm)
        self._previous_timer_s = signal.getitimer(signal.ITIMER_REAL)[0]
        signal.setitimer(signal.ITIMER_REAL, self.seconds, REPEAT_S)
        return self

    def __exit__(self, *exc_info: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._previous_handler)
        if self._previous_timer_s > 0:
            left_s = self._previous_timer_s - (time.perf_counter() - self._started)
            signal.setitimer(signal.ITIMER_REAL, max(left_s, 1e-3))
