"""``metadata.client.probe``: an engine's connector asks it before a metadata call, so that an etcd address where
nothing listens is a miss at once, not after the call's retry deadline."""

import socket

import pytest

from kvpool.errors import MetadataUnavailable
from kvpool.metadata.client import probe
from kvpool.metadata.config import ENDPOINTS_ENV, MetadataConfig


def test_nothing_listening_is_unavailable_at_once_and_says_what_to_check() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, not listening: connections to it are refused
        endpoint = f"127.0.0.1:{unused.getsockname()[1]}"
        with pytest.raises(MetadataUnavailable, match=f"no etcd member accepts a connection \\({endpoint}: ") as err:
            probe(MetadataConfig(endpoints=(endpoint,)))
    assert "attempts" not in str(err.value)  # one try, not the retry loop's
    assert ENDPOINTS_ENV in str(err.value) and "check that etcd is running" in str(err.value)


def test_one_member_listening_is_enough() -> None:
    with socket.socket() as down, socket.create_server(("127.0.0.1", 0)) as up:
        down.bind(("127.0.0.1", 0))
        endpoints = (f"127.0.0.1:{down.getsockname()[1]}", f"127.0.0.1:{up.getsockname()[1]}")
        probe(MetadataConfig(endpoints=endpoints))
