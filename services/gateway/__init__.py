"""Gateway: the OpenAI-compatible HTTP API, validation, tokenization and dispatch."""
