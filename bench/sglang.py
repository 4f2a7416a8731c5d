"""SGLang's HiCache L3 tier on CPU: kvpool's backend beside SGLang's own (HiCacheFile, Mooncake's) and memcpy, in one
run.

Each backend serves a real SGLang storage side: an MHA host pool (``--layout``; ``pin_memory=False``) and SGLang's
``HiCacheController`` over it, the backend made by SGLang's own factory.  One batch (``--batch`` pages of ``--page``
tokens x ``--layers`` layers x ``--heads`` KV heads x ``--dim``, bf16: 8 MiB a page, 1 GiB a batch by default) is
moved, ``--repeat`` times each:

- through the backend's own calls, as the controller makes them for one batch: save (``batch_set_v1``; HiCacheFile:
  the generic ``batch_set`` of flat pages), ``batch_exists`` (median of 50 calls, every page held), load into fresh
  host slots (``batch_get_v1``; HiCacheFile: ``batch_get`` and the copy into the host pool);
- through the controller's threads: ``write_storage`` → the backup thread's ack, and ``prefetch`` → the hit query →
  host slots → the prefetch I/O thread's last ack.

Every load's bytes are checked against the pages saved (crc32c per page).  The rows:

- kvpool, same node: the backend in this process, on the head node of a local 2-node Ray cluster (127.0.0.2-3,
  embedded etcd, a pool node on each), the pages in that node's DRAM;
- kvpool, cross-node: a second storage side in a Ray actor on the other node loads the pages this process saved
  (one-sided NIXL reads; a save lands on the saving node's own pool node first, so there is no cross-node save);
- HiCacheFile: SGLang's file backend in ``--file-dir`` (a directory on disk: reads come from the page cache);
- Mooncake's backend (``MooncakeStore``) on ``mooncake-transfer-engine-non-cuda`` over TCP, a ``mooncake_master`` in a
  private network namespace (as ``bench/transfer.py`` runs it): same node, the backend's own segment; cross-node, the
  segment of a second store client (another process); or the measured reason it does not run;
- memcpy of as many bytes (``np.copyto``, one thread) in the same process beside each timed pass: the limit, and
  each row's ratio to its own (the machine's load moves during a run); and once at the start.

A same-node load's steps alone on one batch: memcpy, crc32c, a copy and its checksum in one pass (``copy_checked``,
what a page read straight into its host slots costs) and the staging path's copy into the page views.  And the
pages-per-object choice: one batch through the pool client directly (``put_batch`` / ``get_into_batch``) as one
object a page and as objects of ``--groups`` pages, same node and read from the other node.

    python bench/sglang.py [--layers 32] [--batch 128] [--repeat 3] [--json bench/results/sglang.json]
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console

from kvpool.bench.limits import memcpy_gbps
from kvpool.bench.sglang_report import figures, grouping, render
from kvpool.pool.config import MiB

console = Console(width=160)


def measure(side: Any, tag: str, repeat: int, expected: list[int], *, save: bool = True) -> dict[str, Any]:
    """One side's figures (seconds of each pass): the backend's calls, then the controller's; ``save``: the side
    saves ``tag``'s pages itself (else it loads what another side saved under ``tag``).  Loads checked against
    ``expected``."""
    out: dict[str, Any] = {"memcpy_s": []}
    direct, ctrl = f"{tag}-direct", f"{tag}-ctrl"
    if save:
        out["save_s"] = []
        for rep in range(repeat):
            out["save_s"].append(side.save(direct))
            out["memcpy_s"].append(side.memcpy.seconds())
            if rep < repeat - 1:
                side.drop(direct)
    out["exists_s"] = side.exists(direct)
    out["load_s"] = []
    for _ in range(repeat):
        seconds, got = side.load(direct)
        out["load_s"].append(seconds)
        out["memcpy_s"].append(side.memcpy.seconds())
        check(got, expected, f"{tag}: load")
    if save:
        out["backup_s"] = []
        for rep in range(repeat):
            out["backup_s"].append(side.backup(ctrl))
            if rep < repeat - 1:
                side.drop(ctrl)
    out["prefetch_s"] = []
    for _ in range(repeat):
        seconds, got = side.prefetch(ctrl)
        out["prefetch_s"].append(seconds)
        check(got, expected, f"{tag}: prefetch")
    return out


def check(got: list[int], expected: list[int], what: str) -> None:
    if got != expected:
        bad = sum(a != b for a, b in zip(got, expected, strict=True))
        raise RuntimeError(f"{what}: {bad} of {len(expected)} pages came back with other bytes")


def attempt(name: str, fn: Any) -> dict[str, Any]:
    """``fn()``'s figures, or the reason it failed (a row's note, never the end of the run)."""
    try:
        out = dict(fn())
        console.print(f"  {name}: done", markup=False)
        return out
    except Exception as exc:
        lines = [ln.strip() for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
        reason = next((ln for ln in reversed(lines) if re.search(r"(Error|Exception)\b", ln)), lines[0])[:300]
        console.print(f"  {name}: {reason}", markup=False, style="yellow")
        return {"note": reason}


# -- the backends ----------------------------------------------------------------------------------------------


def file_rows(shape: Any, args: argparse.Namespace) -> dict[str, Any]:
    from kvpool.bench.sglang_sides import Side

    with tempfile.TemporaryDirectory(prefix="kvpool-bench-hicache-", dir=args.file_dir) as where:
        side = Side(shape, "file", {"file_storage_path": where})
        try:
            return measure(side, "file", args.repeat, side.source_digests())
        finally:
            side.close()


def kvpool_rows(shape: Any, args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    """kvpool same node and cross-node, and the pages-per-object figures, on a pool of its own."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvpool.bench.sglang_sides import RemoteActor, Side, grouped
    from kvpool.metadata.config import MetadataConfig
    from kvpool.pool.config import PoolConfig
    from kvpool.pool.node import start_pool, stop_pool
    from kvpool.servers.etcd import EmbeddedEtcd
    from kvpool.servers.ray_cluster import LocalRayCluster

    with EmbeddedEtcd() as etcd, LocalRayCluster(nodes=2) as cluster:
        metadata = MetadataConfig(endpoints=(etcd.endpoint,), cluster=f"bench-{uuid.uuid4().hex[:8]}")
        pool = PoolConfig(
            metadata=metadata, dram_bytes=2 * shape.batch_bytes + 256 * MiB, nvme_bytes=-1, namespace=metadata.cluster
        )
        start_pool(pool)
        extra = {
            "backend_name": "kvpool",
            "module_path": "kvpool.prefill_decode.sglang.storage",
            "class_name": "KvPoolStorage",
            "interface_v1": 1,
            "etcd": [etcd.endpoint],
            "cluster": metadata.cluster,
            "namespace": pool.namespace,
            "ray_address": cluster.address,
        }
        side = Side(shape, "dynamic", extra)
        remote = None
        try:
            expected = side.source_digests()
            rows["kvpool, same node"] = attempt("kvpool same node", lambda: measure(side, "kv", args.repeat, expected))
            other = cluster.node_ids()[1]
            remote = RemoteActor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(other, soft=False)).remote(
                shape, extra
            )
            rows["kvpool, cross-node"] = attempt(
                "kvpool cross-node", lambda: remote_measure(remote, "kv", args.repeat, expected)
            )
            for tag in ("kv-direct", "kv-ctrl"):
                side.drop(tag)
            client, n = side.backend.connection.connected, args.repeat

            def far(tag: str, g: int) -> dict[str, Any]:
                return attempt(
                    f"{g} pages an object, cross-node", lambda: {"s": ray.get(remote.far_gets.remote(tag, g, n))}
                )

            rows["pages per object"] = attempt(
                "pages per object", lambda: grouped(client, "group", shape, args.groups, n, far)
            )
        finally:
            if remote is not None:
                attempt("closing the actor", lambda: ray.get(remote.close.remote(), timeout=60) or {})
                ray.kill(remote)
            side.close()
            stop_pool(pool)


def remote_measure(remote: Any, tag: str, repeat: int, expected: list[int]) -> dict[str, Any]:
    """:func:`measure` by the actor ``remote`` of what this process saved (no save of its own)."""
    import ray

    out: dict[str, Any] = {"exists_s": ray.get(remote.call.remote("exists", f"{tag}-direct"))}
    out["load_s"], out["prefetch_s"], out["memcpy_s"] = [], [], []
    for _ in range(repeat):
        seconds, got = ray.get(remote.call.remote("load", f"{tag}-direct"))
        check(got, expected, "kvpool cross-node: load")
        out["load_s"].append(seconds)
        out["memcpy_s"].append(ray.get(remote.memcpy.remote()))
    for _ in range(repeat):
        seconds, got = ray.get(remote.call.remote("prefetch", f"{tag}-ctrl"))
        check(got, expected, "kvpool cross-node: prefetch")
        out["prefetch_s"].append(seconds)
    return out


def mooncake_rows(shape: Any, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Mooncake's backend, same node and cross-node, each in a child of this script in a private network namespace
    (Mooncake's transfer engine listens on every address it has); or why it does not run."""
    import importlib.util
    import shutil

    from kvpool.bench.children import run_child

    why = ""
    if importlib.util.find_spec("mooncake") is None:
        why = "not installed (pip install mooncake-transfer-engine-non-cuda)"
    elif shutil.which("unshare") is None:
        why = "needs `unshare` (util-linux) for its private network namespace"
    rows: dict[str, dict[str, Any]] = {}
    for where in ("same node", "cross-node"):
        if why:
            rows[f"Mooncake, {where}"] = {"note": why}
            continue
        cmd = ["unshare", "--net", *([] if os.geteuid() == 0 else ["--map-root-user"]), sys.executable, __file__]
        cmd += ["--_mooncake", where, *shape_args(shape), "--repeat", str(args.repeat)]
        rows[f"Mooncake, {where}"] = attempt(
            f"Mooncake, {where}", lambda c=cmd, w=where: run_child(c, dict(os.environ), f"Mooncake {w}", console)
        )
    return rows


def mooncake_child(shape: Any, where: str, repeat: int) -> None:
    """``--_mooncake``, in a private network namespace: a ``mooncake_master``, Mooncake's backend under SGLang's
    controller with its own segment (same node) or with none, its pages on a second store client's (cross-node);
    one RESULT line."""
    import contextlib
    import signal

    from kvpool.bench.mooncake_peer import (
        MOONCAKE_HOLDER,
        MOONCAKE_READER,
        loopback_namespace,
        start_mooncake_holder,
        start_mooncake_master,
    )
    from kvpool.bench.sglang_sides import Side

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    loopback_namespace()
    env = {**os.environ, "GLOG_minloglevel": "1"}
    room = 3 * shape.batch_bytes  # two batches held, and headroom below its eviction watermark
    with tempfile.TemporaryFile() as log, contextlib.ExitStack() as stack:
        try:
            extra = {
                "master_server_address": start_mooncake_master(stack, log, env),
                "metadata_server": "P2PHANDSHAKE",
                "protocol": "tcp",
                "device_name": "",
                "check_server": False,
                "local_hostname": MOONCAKE_HOLDER,
                "global_segment_size": room,
            }
            if where == "cross-node":
                start_mooncake_holder(stack, log, env, extra["master_server_address"], room)
                os.environ["MC_TCP_BIND_ADDRESS"] = MOONCAKE_READER
                extra.update(local_hostname=MOONCAKE_READER, global_segment_size=0)
            side = Side(shape, "mooncake", extra)
            stack.callback(side.close)
            result = measure(side, "mooncake", repeat, side.source_digests())
            if where == "cross-node":
                result["placed_on"] = mooncake_hosts(side, "mooncake-direct")
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-3000:])
            raise
    print("RESULT", json.dumps(result), flush=True)


def mooncake_hosts(side: Any, tag: str) -> list[str]:
    """Where Mooncake holds ``tag``'s objects (host of each replica's transport endpoint)."""
    backend = side.backend
    keys = [f"{k}_{backend.mha_suffix}_{kv}" for k in backend._tag_keys(side.hashes(tag)) for kv in "kv"]
    descs = backend.store.batch_get_replica_desc(keys)
    return sorted(
        {
            r.get_memory_descriptor().buffer_descriptor.transport_endpoint.rsplit(":", 1)[0]
            if r.is_memory_replica()
            else "disk"
            for k in keys
            for r in descs[k]
        }
    )


# -- the table -------------------------------------------------------------------------------------------------


def shape_args(shape: Any) -> list[str]:
    return [f"--{k}={getattr(shape, k)}" for k in ("layers", "heads", "dim", "page", "batch", "layout")]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32, help="model layers in a page (default 32)")
    ap.add_argument("--heads", type=int, default=8, help="KV heads (default 8)")
    ap.add_argument("--dim", type=int, default=128, help="head size (default 128)")
    ap.add_argument("--page", type=int, default=64, help="tokens a page (SGLang's --page-size; default 64)")
    ap.add_argument("--batch", type=int, default=128, help="pages a batch (SGLang's controller: up to 128)")
    ap.add_argument(
        "--layout",
        default="page_first_direct",
        help="host layout (--hicache-mem-layout; Mooncake's backend takes page_first and page_first_direct for MHA)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="timed passes of each step (median reported)")
    ap.add_argument("--groups", default="1,4,16", help="pages an object for the pages-per-object figures")
    ap.add_argument("--file-dir", default=None, help="where HiCacheFile writes (default: the temp dir)")
    ap.add_argument("--skip", default="", help="comma-separated: file, kvpool, mooncake")
    ap.add_argument("--json", default="bench/results/sglang.json", help="where to write the figures")
    ap.add_argument("--_mooncake", choices=("same node", "cross-node"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.groups = [g for g in (int(x) for x in str(args.groups).split(",")) if 0 < g <= args.batch]
    return args


def main() -> None:
    here = str(Path(__file__).resolve().parent)  # run as a script, this folder would hide the sglang package
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    args = parse_args()
    from kvpool.bench.sglang_sides import Shape

    shape = Shape(args.layers, args.heads, args.dim, args.page, args.batch, args.layout)
    if args._mooncake:
        mooncake_child(shape, args._mooncake, args.repeat)
        return
    t0 = time.perf_counter()
    from kvpool.bench.sglang_sides import load_steps

    memcpy = memcpy_gbps(shape.batch_bytes, repeat=max(3, args.repeat))
    steps = load_steps(shape, max(3, args.repeat))
    console.print(f"{shape.batch} pages of {shape.page_bytes / MiB:.1f} MiB; memcpy {memcpy:.2f} GB/s")
    skip = set(args.skip.split(","))
    rows: dict[str, dict[str, Any]] = {}
    if "kvpool" not in skip:
        kvpool_rows(shape, args, rows)
    if "mooncake" not in skip:
        rows.update(mooncake_rows(shape, args))
    if "file" not in skip:
        rows["SGLang HiCacheFile"] = attempt("HiCacheFile", lambda: file_rows(shape, args))
    per_object = rows.pop("pages per object", {})
    result = {
        "shape": {**vars(shape), "page_bytes": shape.page_bytes, "batch_bytes": shape.batch_bytes},
        "repeat": args.repeat,
        "memcpy_gbps": memcpy,
        "load_steps_gbps": steps,
        "rows": {name: figures(row, shape.batch_bytes, memcpy) for name, row in rows.items()},
        "pages_per_object": grouping(per_object, shape),
        "seconds": time.perf_counter() - t0,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    render(result)
    console.print(f"written {out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
