"""Scaling benchmarks: measure how training scales with the device count, keep the reports."""
