"""Shared fixtures: one real etcd server for the session, a fresh cluster namespace per test; one real Ray cluster
and its shared pools (``pool_shelf``) for the session; one real S3 server (SeaweedFS) for the session, a fresh bucket
per test.  Every test is marked by the folder it lives in: ``integration``
(tests/integration/) or ``faults`` (tests/faults/); tests/unit/ needs no server (``make test-fast``)."""

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvpool.metadata.cache import MetadataCache
from kvpool.metadata.client import EtcdClient
from kvpool.metadata.config import MetadataConfig
from kvpool.metadata.namespace import Namespace
from kvpool.servers.etcd import EmbeddedEtcd

# pytest-xdist's workers inherit COLUMNS=80 and LINES=24 from execnet; a console made under them keeps that width,
# and the CLI tests that give an invocation its own COLUMNS would get 80 columns instead
for _fixed in ("COLUMNS", "LINES"):
    os.environ.pop(_fixed, None)

if TYPE_CHECKING:  # imported lazily below: unit tests do not pay for the pool's client, nor tests without S3 for boto3
    from pools import PoolShelf

    from kvpool.pool.tiers.s3_config import RemoteConfig
    from kvpool.servers.seaweedfs import SeaweedServer


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def metadata_config(etcd_server: EmbeddedEtcd) -> MetadataConfig:
    """Points at the session's etcd, under a cluster name no other test uses."""
    return MetadataConfig(endpoints=(etcd_server.endpoint,), cluster=f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=2)


@pytest.fixture
def etcd(metadata_config: MetadataConfig) -> Iterator[EtcdClient]:
    client = EtcdClient(metadata_config)
    yield client
    client.delete_prefix(Namespace(metadata_config.cluster).root)
    client.close()


@pytest.fixture
def namespace(metadata_config: MetadataConfig) -> Namespace:
    return Namespace(metadata_config.cluster)


@pytest.fixture
def cache(etcd: EtcdClient, namespace: Namespace) -> Iterator[MetadataCache]:
    with MetadataCache(etcd, namespace) as c:
        yield c


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[list[str]]:
    """One real multi-node Ray cluster for the whole session: a head and two nodes on 127.0.0.2-4.

    Returns the Ray node ids, head first; the test process is a driver attached to the head.
    """
    from kvpool.servers.ray_cluster import LocalRayCluster

    with LocalRayCluster(nodes=3) as cluster:
        yield cluster.node_ids()


@pytest.fixture(scope="session")
def pool_shelf(ray_cluster: list[str], etcd_server: EmbeddedEtcd) -> "Iterator[PoolShelf]":
    """The session's shared pools, one per shape while tests of that shape run, each lent to a test emptied
    (``tests/pools.py``)."""
    from pools import PoolShelf

    shelf = PoolShelf(etcd_server.endpoint, ray_cluster)
    yield shelf
    shelf.close()


@pytest.fixture(scope="session")
def s3_server() -> "Iterator[SeaweedServer]":
    """One real SeaweedFS S3 server for the session, refusing requests not signed with its generated keys."""
    from kvpool.servers.seaweedfs import SeaweedServer

    access_key_id, secret_access_key = SeaweedServer.generate_credentials()
    with SeaweedServer(access_key_id=access_key_id, secret_access_key=secret_access_key) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: "SeaweedServer") -> "Iterator[RemoteConfig]":
    """A ``RemoteConfig`` for a fresh bucket of the session's S3 server (deleted afterwards), flushing after 0.5 s."""
    from kvpool.pool.tiers.s3_config import RemoteConfig

    bucket = f"kvpool-{uuid.uuid4().hex[:10]}"
    s3_server.create_bucket(bucket)
    yield RemoteConfig(
        bucket=bucket,
        endpoint_url=s3_server.endpoint_url,
        access_key_id=s3_server.access_key_id,
        secret_access_key=s3_server.secret_access_key,
        flush_after_s=0.5,
    )
    if s3_server.running():
        s3_server.delete_bucket(bucket)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-s", type=float, default=20.0, help="How long tests/faults/test_soak.py runs its traffic (seconds)."
    )


#: the marker each top-level folder of tests/ gives its tests (declared in pyproject.toml)
FOLDER_MARKERS = {"integration": pytest.mark.integration, "faults": pytest.mark.faults}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        path = Path(item.path)
        if path.is_relative_to(tests) and (mark := FOLDER_MARKERS.get(path.relative_to(tests).parts[0])):
            item.add_marker(mark)


#: ``make test`` runs the suite in two lanes, one pytest-xdist worker each (``-n 2``): this one, and the engines'
#: (engine/, pool/, prefill_decode/, the stack's demo), each lane with its own etcd, Ray cluster and pools.  Beside a
#: busy core two workers get more of the machine than one; sized so that each lane takes about half the time.
SECOND_LANE = tuple(
    f"tests/{where}"
    for where in (
        "unit/",
        "faults/",
        "integration/cli/test_cli.py",
        "integration/launcher/",
        "integration/metadata/",
        "integration/pool/test_cli_pool.py",
        "integration/remote/",
        "integration/sglang/",
        "integration/transport/",
    )
)


@pytest.hookimpl(optionalhook=True)  # a pytest without xdist runs one lane
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Each lane whole to one worker, in the order collected (xdist's ``loadgroup`` would, but it cannot rename
    node ids under this pytest)."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "second" if nodeid.startswith(SECOND_LANE) else "engines"

    return Lanes(config, log)
