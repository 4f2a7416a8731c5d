"""The workloads the benchmarks replay: Mooncake's published traces (``mooncake``), read by the fleet replay
(``bench/fleet*.py``) and the serving bench (``bench/serving``)."""
