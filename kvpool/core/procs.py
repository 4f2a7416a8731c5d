"""What the kernel says of a process, from ``/proc/<pid>/stat``: read alike by the watchdog that stops what a killed
kvpool left (:mod:`kvpool.servers.watchdog`) and by the reaper of dead pool nodes' segments
(:func:`kvpool.pool.segment.reap_stale_segments`)."""


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after ``pid (comm)``: state, ppid, pgrp, session, ... (field 19: its start
    time in clock ticks since boot); None: no such process, or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
