"""The capacity advisor against replays (``bench/routing.py``): each model the advisor could assume, from the one
stack it started with to what ``kvpool advise`` does now, predicted from one replay's access logs; and the share
of logged lookups that found their object held (the per-object hit ratio, beside the prefix ratio measured)."""

import json

from kvpool.pool.advisor import curve_of_log, read_access_logs, tier_hits, usable_bytes

MODELS = {  #: what the advisor assumes, from the single stack it started with to what kvpool advise does now
    "one stack": {"per_node": False, "prefix": False, "logged": False, "watermarks": False},
    "+ prefix rule": {"per_node": False, "prefix": True, "logged": False, "watermarks": False},
    "+ per-node stacks": {"per_node": True, "prefix": True, "logged": False, "watermarks": False},
    "+ concurrent writes": {"per_node": True, "prefix": True, "logged": True, "watermarks": False},
    "+ watermark factor": {"per_node": True, "prefix": True, "logged": True, "watermarks": True},
}
ADVISED = "+ concurrent writes"  #: the model kvpool advise uses (the watermark factor measured worse: docs/routing.md)


def predicted_hit_ratios(
    log_paths: list[str], capacities: list[tuple[float, float]], logged_at: tuple[float, float]
) -> dict[str, list[float]]:
    """Each model's hit ratio for pools of these ``(DRAM, NVMe)`` bytes, from the access logs of one replay run
    at ``logged_at`` bytes."""
    log = read_access_logs(log_paths)
    out: dict[str, list[float]] = {}
    for name, m in MODELS.items():
        usable = usable_bytes if m["watermarks"] else lambda dram, nvme: (dram, nvme)
        at = sum(usable(*logged_at)) if m["logged"] else 0.0
        curve = curve_of_log(log, per_node=m["per_node"], prefix=m["prefix"], logged_at=at)
        ratios = []
        for dram, nvme in capacities:
            hits = tier_hits(curve, *usable(dram, nvme))
            ratios.append(hits.dram + hits.nvme)
        out[name] = ratios
    return out


def held_at_lookup(log_paths: list[str]) -> float:
    """The share of logged object lookups that found the object held (the per-object hit ratio; the prefix
    lookup's ratio also counts the held objects after a missing one as misses)."""
    held = total = 0
    for path in log_paths:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                sizes = row.get("sizes", [row["size"]] if "size" in row else [])  # lookup lines, or older key lines
                total += len(sizes)
                held += sum(size > 0 for size in sizes)
    return held / total if total else 0.0
