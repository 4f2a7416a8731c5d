"""Free ports on a loopback (or any local) address: what every launcher, engine helper and test binds its servers to.

Here, in the bottom layer, so that the launchers (``kvpool.servers``) and the engine adapters (SGLang's one-rank TP
group) take it from below rather than from each other."""

import contextlib
import socket


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct ports free on ``host`` now (all bound at once, so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]


def free_port(host: str) -> int:
    """One port free on ``host`` now."""
    return free_ports(host, 1)[0]
