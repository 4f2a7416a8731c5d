"""A pool node, the client and the node protocol import without torch, and a node on a host without GPUs never
imports it for its stats.

Every pool node is its own process (a Ray actor), started several times per pool; torch takes a second or more of
CPU to import, several on a loaded machine, and a pool whose tiers store chunks raw never touches a tensor.  So
torch is imported where a tensor is made or read (a codec, device reads, GPUDirect I/O), never with these modules.
Each check runs in a fresh interpreter: this one has torch loaded already.
"""

import glob
import os
import subprocess
import sys

import pytest


def _run(code: str) -> str:
    # -P: import the installed kvpool (as the test process does), not the bare kvpool/ folder of the working directory
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip()


def test_node_client_and_protocol_do_not_import_torch() -> None:
    code = "import kvpool.pool.node.node, kvpool.pool.client, kvpool.pool.protocol, sys; print('torch' in sys.modules)"
    assert _run(code) == "False", "torch is imported at module level on the node's import path: import it lazily"


@pytest.mark.skipif(
    bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/dxg"), reason="a GPU host: torch counts its devices"
)
def test_the_nvme_io_path_of_a_host_without_gpus_needs_no_torch() -> None:
    # a node's stats and metrics report it from the start (the metrics registry collects once when it registers)
    code = "import sys; from kvpool.pool.gds import nvme_io_path; print(nvme_io_path().name, 'torch' in sys.modules)"
    assert _run(code) == "posix False"
