"""An injectable clock, so that lease and timeout logic can be tested without sleeping."""

import threading
import time
from typing import Annotated, Protocol

from msgspec import Meta

from kvpool.core.config import checked


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a monotonic scale, for intervals and deadlines."""
        ...

    def time(self) -> float:
        """Seconds since the epoch, for timestamps stored in records."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class ManualClock:
    """A clock that only moves when a test calls :meth:`advance`."""

    def __init__(self, start: float = 1_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def time(self) -> float:
        with self._lock:
            return self._now

    @checked
    def advance(self, seconds: Annotated[float, Meta(ge=0, description="a number of seconds >= 0")]) -> None:
        with self._lock:
            self._now += seconds


SYSTEM_CLOCK = SystemClock()
