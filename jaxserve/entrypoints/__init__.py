"""Front doors to the engine: the OpenAI-compatible HTTP server (``openai/``) and the batch CLI."""
