"""A transfer target in its own process: a DRAM segment with known bytes, registered with NIXL.

``python target.py DIRECTORY KIND``: the segment file goes in DIRECTORY, which the test removes (a killed
target cannot remove its own file); KIND is ``nixl``.

Prints ``DESCRIPTOR <hex>`` when ready; then each stdin line is a command: ``crc OFFSET LENGTH`` prints
the crc32c of that range; ``quit`` exits.
"""

import sys

import crc32c
import numpy as np

from kvpool.pool.segment import DramSegment
from kvpool.transport.nixl import NixlTransport

SIZE = 64 << 20

seg = DramSegment.create(SIZE, sys.argv[1])
seg.write(0, np.arange(SIZE, dtype=np.uint8) * 7)
assert sys.argv[2] == "nixl", sys.argv[2]
transport = NixlTransport(serve=True)
transport.register("dram0", seg.base_address, seg.capacity)
print("DESCRIPTOR", transport.descriptor().hex(), flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "crc":
        off, length = map(int, args)
        with seg.view(off, length) as v:
            print("CRC", crc32c.crc32c(v), flush=True)
    elif cmd == "wait":  # a notification, then its sender
        print("FROM", transport.wait_notification(args[0].encode(), timeout_s=30), flush=True)
    elif cmd == "quit":
        break
transport.close()
seg.close()
