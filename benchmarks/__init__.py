"""Side-by-side measurements of flashckpt against plain torch and raw memory/disk limits.

Benchmarks are informational: they never pass or fail and are not part of the test run.
Run one with ``python -m benchmarks.bench_snapshot`` from the repository root.
"""
