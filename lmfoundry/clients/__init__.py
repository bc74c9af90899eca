"""The ways a stage asks a language model: a checkpoint loaded in process (checkpoint.py) or any
OpenAI-compatible endpoint over HTTP (openai.py, the one client evaluation, alignment, agents and
the quickstart share)."""
