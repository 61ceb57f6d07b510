"""Benchmarks that drive the public APIs: comm microbenchmarks (bench.comm), step-time breakdown."""
