"""The agent platform: durable workflows (workflow.py), the tools they call (tools.py), the API on
Ray Serve (api.py) and run traces (tracing.py)."""
