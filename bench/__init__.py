"""Benchmarks: each prints its figures beside this machine's limits measured in the same run (installed as
``kvpool.bench``; the scripts run as ``python bench/NAME.py``)."""
