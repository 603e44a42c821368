"""Benchmarks: tables of time and peak memory against a baseline measured in the same run."""
