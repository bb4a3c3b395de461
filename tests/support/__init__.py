"""Test-only code shared by the tests, their subprocess scripts and some benchmarks (tests/support/README.md)."""
