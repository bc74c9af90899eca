"""Ray Serve: the inference engine and the OpenAI-compatible API."""
