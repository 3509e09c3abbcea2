"""OpenAI-compatible API: request models (``protocol``), completions and chat serving, the aiohttp app.

``api_server`` is the HTTP layer; ``serving_completion`` and ``serving_chat`` turn validated
requests into engine calls and engine outputs into OpenAI-shaped response bodies as plain
functions, so the batch CLI reuses them without HTTP.
"""
