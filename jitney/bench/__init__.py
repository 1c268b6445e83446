"""Benchmarks: the seed's slot micro-benchmark, a load generator for any OpenAI-compatible server,
offline throughput against the baselines, and calibration of the simulator against the engine.

Every latency and throughput figure is computed by :mod:`jitney.metrics`, so measured and
simulated runs of the same traffic compare field by field.
"""
