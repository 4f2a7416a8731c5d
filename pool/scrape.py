"""Reading a pool node's Prometheus metrics endpoint: ``kvpool status``, the chaos bench."""

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

#: the labels a sample's name keeps (``name{level}``, ``name{result}``, ``name{mode}``, ``name{kind}``,
#: ``name{cause}``, ``name{direction}``, ``name{tenant,tier}``); every other label is summed over
KEPT_LABELS = ("level", "result", "mode", "kind", "cause", "direction")
TENANT_LABELS = ("tenant", "tier")


def scrape(address: str, timeout_s: float = 1.0) -> dict[str, float]:
    """A node's metrics (``host:port``), summed per metric name (``name{level}`` for watermarks,
    ``name{result}`` for lookups); empty if the node does not answer."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return summed(text)


def summed(text: str) -> dict[str, float]:
    """Prometheus exposition ``text``, summed per metric name and kept label."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = next((sample.labels[k] for k in KEPT_LABELS if k in sample.labels), None)
            if "tenant" in sample.labels:
                label = ",".join(sample.labels.get(k, "") for k in TENANT_LABELS)
            name = sample.name + (f"{{{label}}}" if label is not None else "")
            out[name] = out.get(name, 0.0) + sample.value
    return out
