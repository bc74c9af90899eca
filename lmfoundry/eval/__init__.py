"""Evaluation: held-out perplexity now; task suites and gates build on it."""
