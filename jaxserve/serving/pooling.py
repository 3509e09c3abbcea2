"""The pooling endpoints of a ``--runner pooling`` server: ``/v1/embeddings`` (OpenAI's shape),
``/pooling`` and ``/v1/score`` (vLLM's).

Each input becomes one prompt-only engine request (``max_tokens=0``) through the same
``EngineClient.add_request`` as generation, so embeddings share the scheduler with everything
else (chunked prefill, prefix caching for LAST pooling, batching); its final ``RequestOutput``
carries the pooled vector (``RequestOutput.pooled``), which ``jaxserve.pooling.finish_embedding``
truncates (``dimensions``) and normalises. A score is the cosine of two such embeddings.
"""

from __future__ import annotations

import base64
import dataclasses
import time
from typing import Any

import numpy as np

from jaxserve.engine.protocol import EngineClient
from jaxserve.pooling import cosine_similarity, finish_embedding
from jaxserve.sampling_params import SamplingParams
from jaxserve.serving.completion import tokenize_prompts
from jaxserve.serving.engine_calls import collect_all, random_id, start_requests
from jaxserve.serving.errors import APIError, from_value_error
from jaxserve.serving.protocol import EmbeddingRequest, ScoreRequest
from jaxserve.serving.validation import ServingInfo, check_prompt_ids

_PROMPT_ONLY = SamplingParams(max_tokens=0)


@dataclasses.dataclass
class PoolingJob:
    """A prepared pooling request.

    Attributes:
      request: the validated body (EmbeddingRequest or ScoreRequest).
      request_id: the response id; its engine requests are ``{request_id}-{i}``.
      kind: "embedding" (``/v1/embeddings``), "pooling" (``/pooling``) or "score".
      prompt_ids: the token ids of every text to embed (score: text_1's, then text_2's).
      num_first: score: how many of ``prompt_ids`` are text_1's.
      normalize: L2-normalise the vectors.
      model: the ``model`` to answer with.
      created: Unix seconds.
    """

    request: Any
    request_id: str
    kind: str
    prompt_ids: list[list[int]]
    num_first: int
    normalize: bool
    model: str
    created: int

    @property
    def first_prompt(self) -> list[int]:
        """The first prompt's token ids (what a router matches against replicas' caches)."""
        return self.prompt_ids[0]


def require_pooling(info: ServingInfo, url: str) -> None:
    """Raises the 400 a generate server answers to a pooling route, and the reverse.

    Raises:
      APIError: 400 ``model_not_supported`` naming ``--runner``.
    """
    pooling_url = url in POOLING_KINDS
    if pooling_url and info.runner != "pooling":
        raise APIError(
            f"{url} needs a pooling model: this server runs --runner generate; start it with "
            "--runner pooling (or --convert embed for a causal-LM checkpoint) to serve embeddings",
            status=400,
            param="model",
            code="model_not_supported",
        )
    if not pooling_url and info.runner == "pooling":
        raise APIError(
            f"{url} generates text: this server runs --runner pooling (embeddings); use "
            "/v1/embeddings, /pooling or /v1/score, or start it with --runner generate",
            status=400,
            param="model",
            code="model_not_supported",
        )


POOLING_KINDS = {
    "/v1/embeddings": "embedding",
    "/pooling": "pooling",
    "/v1/score": "score",
    "/score": "score",  # vLLM serves both
}
"""The pooling endpoints by URL path -> their kind."""


def prepare_pooling(url: str, request: Any, info: ServingInfo, tokenizer: Any) -> PoolingJob:
    """Tokenizes and checks a validated EmbeddingRequest (``/v1/embeddings``, ``/pooling``) or
    ScoreRequest (``/v1/score``).

    Raises:
      APIError: 404 for an unknown model, 400 for an empty, out-of-vocabulary or too long input,
        or ``dimensions`` below 1 (naming the field).
    """
    info.check_model(request.model)
    kind = POOLING_KINDS[url]
    normalize = info.pooling_normalize
    if kind == "score":
        first = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        second = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        ids_1, _ = tokenize_prompts(first, tokenizer, info, field="text_1")
        ids_2, _ = tokenize_prompts(second, tokenizer, info, field="text_2")
        prompt_ids, num_first, field = ids_1 + ids_2, len(ids_1), "text_1"
    else:
        if request.dimensions is not None and request.dimensions < 1:
            raise APIError(
                f"dimensions must be >= 1, got {request.dimensions}",
                status=400,
                param="dimensions",
            )
        prompt_ids, _ = tokenize_prompts(request.input, tokenizer, info, field="input")
        num_first, field = len(prompt_ids), "input"
        if request.normalize is not None:
            normalize = request.normalize
    for ids in prompt_ids:
        check_prompt_ids(ids, info, field=field)
    return PoolingJob(
        request=request,
        request_id=random_id("embd" if kind == "embedding" else kind),
        kind=kind,
        prompt_ids=prompt_ids,
        num_first=num_first,
        normalize=normalize,
        model=request.model or info.model_name,
        created=int(time.time()),
    )


REQUEST_MODELS = {"embedding": EmbeddingRequest, "pooling": EmbeddingRequest, "score": ScoreRequest}
"""The request model of each pooling kind."""


def _vectors(job: PoolingJob, outputs: list) -> list[np.ndarray]:
    dims = None if job.kind == "score" else job.request.dimensions
    try:
        return [
            finish_embedding(out.pooled, normalize=job.normalize, dimensions=dims)
            for out in outputs
        ]
    except ValueError as exc:
        raise from_value_error(exc) from None


def _encode(vec: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as the openai client decodes it
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


async def create_pooling(engine: EngineClient, job: PoolingJob) -> dict[str, Any]:
    """Runs every prompt of ``job`` on ``engine`` and builds the response body.

    Raises:
      APIError: 400 if the engine refused a prompt, 503 if it died meanwhile.
    """
    params = [_PROMPT_ONLY] * len(job.prompt_ids)
    priority = job.request.priority
    streams = await start_requests(
        engine, job.request_id, job.prompt_ids, params, priority=priority
    )
    outputs = await collect_all(streams)
    vectors = _vectors(job, outputs)
    prompt_tokens = sum(len(ids) for ids in job.prompt_ids)
    body: dict[str, Any] = {
        "id": job.request_id,
        "object": "list",
        "created": job.created,
        "model": job.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    if job.kind == "score":
        first, second = vectors[: job.num_first], vectors[job.num_first :]
        if len(first) == 1:
            first = first * len(second)
        body["data"] = [
            {"index": i, "object": "score", "score": cosine_similarity(a, b)}
            for i, (a, b) in enumerate(zip(first, second))
        ]
        return body
    fmt = job.request.encoding_format
    key = "embedding" if job.kind == "embedding" else "data"
    body["data"] = [
        {"index": i, "object": job.kind, key: _encode(vec, fmt)} for i, vec in enumerate(vectors)
    ]
    return body
