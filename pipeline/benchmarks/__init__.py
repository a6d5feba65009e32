"""Benchmarks: functions that measure and print ratios against a baseline; never unit tests."""
