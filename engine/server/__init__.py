"""The OpenAI-compatible server over the serving engine (``flashrt serve``): app, protocol, metrics."""
