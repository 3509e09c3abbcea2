"""One streamed ``/v1/completions`` request, timed as vLLM's ``bench serve`` times it.

The request (OpenAI API reference, "Completions", plus vLLM's ``ignore_eos``)::

    {"model", "prompt": text or token ids, "max_tokens": output_len, "temperature",
     "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": ...}

The answer is server-sent events (``data: {json}`` lines, ``data: [DONE]`` last, ``:`` comment
lines ignored). A chunk with a non-empty ``choices`` list is a content chunk (its text may be
empty, as in vLLM's client); its arrival time (``time.perf_counter``) feeds TTFT, ITL and the
end-to-end latency (see ``stats``). The usage chunk (empty ``choices``) gives the token counts;
without one, output tokens are the number of content chunks with non-empty text.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from jaxserve.bench.stats import RequestResult
from jaxserve.bench.workloads import BenchRequest


def completion_payload(
    model: str,
    request: BenchRequest,
    *,
    ignore_eos: bool = True,
    temperature: float = 0.0,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of one streamed completion request."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if extra_body:
        body.update(extra_body)
    return body


async def send_completion(
    session: aiohttp.ClientSession,
    api_url: str,
    payload: dict[str, Any],
    request: BenchRequest,
    *,
    headers: dict[str, str] | None = None,
    start_time: float = 0.0,
) -> RequestResult:
    """Sends one streamed completion and times its chunks.

    Args:
      session: an open aiohttp session (its timeout applies).
      api_url: full URL of the completions endpoint.
      payload: the body (``completion_payload``).
      request: the workload request (for its prompt length and kind label).
      headers: extra headers (``Authorization``).
      start_time: seconds from the benchmark start, recorded in the result.

    Returns:
      A RequestResult; ``success`` is False with ``error`` set on a non-200 answer, an error
      event in the stream, a stream without content chunks, or a connection failure. It
      never raises for those.
    """
    result = RequestResult(prompt_len=request.prompt_len, start_time=start_time, kind=request.kind)
    usage: dict[str, Any] | None = None
    text_chunks = 0
    sent = time.perf_counter()
    last = sent
    first = True
    try:
        async with session.post(api_url, json=payload, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):  # blank lines, comments, other SSE fields
                    continue
                data = line[len(b"data:") :].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return result
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if first:
                        result.ttft = now - sent
                        first = False
                    else:
                        result.itl.append(now - last)
                    last = now
                    if chunk["choices"][0].get("text"):
                        text_chunks += 1
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if first:
        result.error = "the stream ended without a content chunk"
        return result
    result.latency = last - sent
    if usage is not None:
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_len = int(usage.get("prompt_tokens") or request.prompt_len)
    else:
        result.output_tokens = text_chunks
    result.success = True
    return result
