"""The resource planner: memory, throughput and every feasible parallel layout for a model, a
training recipe and a cluster (search.py)."""
