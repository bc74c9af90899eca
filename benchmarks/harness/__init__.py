"""Harnesses that both the test suite and the benchmarks drive: a peak-memory measurement of real
DeepSpeed steps and a live elasticity drill. Import as `harness.*` with benchmarks/ on sys.path
(a benchmark run as a script has it; tests/conftest.py adds it)."""
