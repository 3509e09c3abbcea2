"""Schemathesis over ``/openapi.json``: valid and mutated requests to every route, no 5xx.

``fuzz_server(url, max_examples)`` fetches the server's own OpenAPI document, draws
``max_examples`` cases (positive and negative generation, derandomized so CI is repeatable) and
sends each; any 5xx, or a 4xx without OpenAI's error object, fails with the case's curl line.
"""

from __future__ import annotations

import httpx2 as httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

GENERATION_FIELDS = {
    "/v1/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/responses": ("max_output_tokens",),
}


def _bound_cost(case):
    """Keeps each case's generation short (at most 4 tokens, n at most 4) so a bounded run stays
    a few seconds; only integer values are rewritten, so wrong types are still sent."""
    body = case.body
    fields = GENERATION_FIELDS.get(case.path)
    if isinstance(body, dict) and fields:
        if not any(f in body for f in fields):
            body[fields[0]] = 4
        for field in (*fields, "n"):
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > 4:
                body[field] = 4
    return case


def fuzz_server(
    url: str, max_examples: int, timeout_s: float = 30.0, paths: list[str] | None = None
) -> dict[int, int]:
    """Fuzzes the server at ``url`` with ``max_examples`` cases, half valid by the schema and
    half mutated (two runs: drawing from ``one_of`` the two costs several times more per case);
    returns the count of each status seen. ``paths``: only these routes (default: all)."""
    doc = httpx.get(url + "/openapi.json", timeout=timeout_s).json()
    schema = schemathesis.openapi.from_dict(doc)
    if paths is not None:
        schema = schema.include(path=paths)
    seen: dict[int, int] = {}

    def send(case) -> None:
        response = case.call(base_url=url, timeout=timeout_s)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        ok = response.status_code < 500
        if ok and response.status_code >= 400:
            body = response.json()
            ok = set(body) == {"error"} and bool(body["error"]["message"])
        assert ok, f"{response.status_code} {response.text[:300]}\n{case.as_curl_command()}"

    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

        @settings(
            max_examples=max(1, max_examples // 2),
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=schema.as_strategy(mode).map(_bound_cost))
        def one(case):
            send(case)

        one()
    return seen
