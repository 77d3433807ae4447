"""`omni-server bench`: load a running server through its HTTP API and report latency/throughput."""

from omni_server.bench.runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench"]
