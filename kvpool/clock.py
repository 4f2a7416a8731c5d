"""An injectable clock, so that lease and timeout logic can be tested without sleeping."""

import threading
import time
from typing import Protocol

from kvpool.errors import ConfigError


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

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ConfigError(f"seconds must be >= 0, got {seconds}")
        with self._lock:
            self._now += seconds


SYSTEM_CLOCK = SystemClock()
