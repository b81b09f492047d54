"""Helpers of the reliability tests (tests/test_reliability*.py) and of the long runs behind
docs/reliability.md (benchmarks/reliability.py), a module per kind of trial."""
