"""The OpenAI-compatible API without a transport: what the HTTP server, ``run-batch`` and the Ray
ingress share.

    protocol       request bodies (pydantic models), validated with OpenAI's and vLLM's rules
    errors         OpenAI-shaped errors (``APIError``: status, type, param, code)
    json_io        strict JSON parsing of request bodies; the one compact JSON encoding
    validation     the served model's facts (``ServingInfo``) and the request checks using them
    completion     /v1/completions: request -> engine requests -> response or chunks
    chat           /v1/chat/completions: messages -> chat template -> engine request -> ...
    tool_calls     chat tool calling: plans, parsers, streamed tool-call deltas
    logprobs       engine logprobs in OpenAI's two response shapes
    engine_calls   starting a response's engine requests, collecting and merging their outputs

Nothing here imports aiohttp; the transports (``jaxserve.entrypoints``) read bodies and write
what these functions return.
"""
