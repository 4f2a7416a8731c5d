"""The multi-node benchmark: ``kvpool bench`` as a script (same options; ``--help`` lists them).

    python bench/cluster.py                        # a local 3-node cluster on loopback, embedded etcd
    python bench/cluster.py --ray-address HEAD:6379 --etcd HEAD:2379    # a running pool (ray up)

Node-to-node put/get GB/s per tier, scaling as nodes read at once, TTFT cold and warm, each beside this
machine's memcpy, loopback TCP and O_DIRECT disk limits; writes bench/results/cluster.{json,png}.
"""

import sys

from kvpool.cli import app

if __name__ == "__main__":
    app(["bench", *sys.argv[1:]], prog_name="bench/cluster.py")
