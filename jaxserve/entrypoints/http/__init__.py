"""The HTTP transport of the OpenAI-compatible API (aiohttp): routes, middlewares, SSE writing.

What a request means (validation, prompts, engine calls, response bodies) lives in
``jaxserve.serving``; ``api_server`` reads bodies, calls it, and writes what it returns.
"""
