"""A pool node, the client and the node protocol import without torch.

Every pool node is its own process (a Ray actor), started several times per pool; torch takes a second or more of
CPU to import, several on a loaded machine, and a pool whose tiers store chunks raw never touches a tensor.  So
torch is imported where a tensor is made or read (a codec, device reads, GPUDirect I/O), never with these modules.
"""

import subprocess
import sys


def test_node_client_and_protocol_do_not_import_torch() -> None:
    code = "import kvpool.pool.node.node, kvpool.pool.client, kvpool.pool.protocol, sys; print('torch' in sys.modules)"
    # -P: import the installed kvpool (as the test process does), not the bare kvpool/ folder of the working directory
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False", (
        "torch is imported at module level on the node's import path: import it lazily"
    )
