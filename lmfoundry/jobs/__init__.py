"""Thin entry points, one per stage: `python -m lmfoundry.jobs.<stage> CONFIG ...`."""
