"""Schemathesis over ``/openapi.json``: valid and mutated requests to every route, with the
strict checks: no 5xx, every schema-valid body accepted, every schema-invalid body refused,
statuses, content types and error bodies as documented (#38 deliverable 7).

``fuzz_server(url, max_examples)`` fetches the server's own OpenAPI document, draws
``max_examples`` cases (positive and negative generation, derandomized so CI is repeatable) and
sends each; any failed check, or a 4xx without OpenAI's error object, fails with the case's
curl line. One rule is left out, for bodies only: a schema-valid body whose acceptance depends
on a compiler (a grammar, regex or JSON schema in ``structured_outputs`` / ``response_format``,
a tool's parameter schema: ``openapi.UNEXPRESSED``) is not required to be accepted. A route
the server's runner does not answer takes no body in the document (``{"not": {}}``); it is not
drawn from but sent bodies that must each be a 4xx.
"""

from __future__ import annotations

import httpx2 as httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

STRICT_CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
    checks.positive_data_acceptance,
    checks.negative_data_rejection,
    checks.missing_required_header,
    checks.unsupported_method,
]
COMPILED_FIELDS = ("structured_outputs", "response_format", "tools")
"""Body fields whose acceptance depends on a compiler (``/v1/responses``: also ``text``, whose
``format`` may carry a JSON schema)."""

GENERATION_FIELDS = {
    "/v1/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
    "/v1/responses": ("max_output_tokens",),
}


def _is_int(value) -> bool:
    """An integer as JSON Schema counts them (``2.0`` is one)."""
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _bound_cost(case):
    """Keeps each case's generation short (at most 4 tokens, n at most 4) so a bounded run stays
    a few seconds; only integer values are rewritten, so wrong types are still sent. A
    ``min_tokens`` above the lowered cap is lowered with it (min_tokens <= max_tokens is a rule
    the document cannot express: ``openapi.UNEXPRESSED``)."""
    body = case.body
    fields = GENERATION_FIELDS.get(case.path)
    if isinstance(body, dict) and fields:
        before = dict(body)
        if not any(f in body for f in fields):
            body[fields[0]] = 4
        for field in (*fields, "n"):
            value = body.get(field)
            if _is_int(value) and value > 4:
                body[field] = 4
        caps = [body[f] for f in fields if _is_int(body.get(f))]
        if caps and _is_int(body.get("min_tokens")) and body["min_tokens"] > min(caps):
            body["min_tokens"] = min(caps)
        positive = case.meta is not None and case.meta.generation.mode.is_positive
        if positive and _is_int(body.get("best_of")):  # best_of == n: not expressible
            body["best_of"] = body["n"] if _is_int(body.get("n")) else 1
        if any(body[k] is not v for k, v in before.items()):  # a value it had was changed
            _REWRITTEN.add(id(case))
    if isinstance(body, dict) and case.path in POOLING_PATHS:
        _fit_pooling(case, body)
    return case


POOLING_PATHS = ("/v1/embeddings", "/pooling", "/v1/score", "/score")
FUZZ_DIMENSIONS = 8
"""``dimensions`` above this are lowered (the hidden size bounds it: ``openapi.UNEXPRESSED``;
every model served in the tests has at least this many)."""


def _fit_pooling(case, body) -> None:
    """The pooling routes' rules the document cannot express (``openapi.UNEXPRESSED``), made to
    hold in a valid case: ``dimensions`` at most the hidden size, and a ``text_2`` list as long
    as a ``text_1`` list of several texts (repeated or cut)."""
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    before = dict(body)
    if _is_int(body.get("dimensions")) and body["dimensions"] > FUZZ_DIMENSIONS:
        body["dimensions"] = FUZZ_DIMENSIONS
    one, two = body.get("text_1"), body.get("text_2")
    if positive and isinstance(one, list) and len(one) > 1 and isinstance(two, list) and two:
        body["text_2"] = (two * len(one))[: len(one)]
    if any(body[k] is not v for k, v in before.items()):
        _REWRITTEN.add(id(case))


_REWRITTEN: set[int] = set()
"""Cases whose values ``_bound_cost`` changed: a negative case may have lost its invalid part
(its rejection is not checked)."""


def refused_routes(doc: dict) -> list[str]:
    """The POST routes whose body schema accepts nothing (``{"not": {}}``: the routes this
    server's runner does not answer, ``openapi._runner_serves``)."""
    out = []
    for path, ops in doc["paths"].items():
        body = ops.get("post", {}).get("requestBody", {})
        schema = body.get("content", {}).get("application/json", {}).get("schema", {})
        if schema.get("not") == {}:
            out.append(path)
    return out


def fuzz_server(
    url: str,
    max_examples: int,
    timeout_s: float = 30.0,
    strict: bool = True,
    paths: list[str] | None = None,
) -> dict[int, int]:
    """Fuzzes the server at ``url`` with ``max_examples`` cases, half valid by the schema and
    half mutated (two runs: drawing from ``one_of`` the two costs several times more per case);
    returns the count of each status seen.

    ``strict``: also run schemathesis' strict checks (the fake-engine server, whose
    ``max_model_len`` leaves room for any prompt the document allows); False: only no 5xx
    and OpenAI's error object (a real engine's small context refuses long prompts).
    ``paths``: only these routes (default: all). A route whose body schema accepts nothing
    (``refused_routes``: schemathesis cannot draw from it) is sent two bodies instead, each of
    which must be a 4xx with OpenAI's error object."""
    doc = httpx.get(url + "/openapi.json", timeout=timeout_s).json()
    schema = schemathesis.openapi.from_dict(doc)
    if paths is not None:
        schema = schema.include(path=paths)
    seen: dict[int, int] = {}
    refused = [p for p in refused_routes(doc) if paths is None or p in paths]
    if refused:  # no body is valid there: nothing to generate, every body must be a 4xx
        schema = schema.exclude(path=refused)
        for path in refused:
            for body in ({}, {"prompt": "x", "input": "x", "text_1": "a", "text_2": "b"}):
                response = httpx.post(url + path, json=body, timeout=timeout_s)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                error = response.json().get("error") or {}
                assert 400 <= response.status_code < 500 and error.get("message"), (
                    f"{path}: {response.status_code} {response.text[:300]}"
                )
        if paths is not None and set(paths) <= set(refused):
            return seen

    def send(case) -> None:
        response = case.call(base_url=url, timeout=timeout_s)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        ok = response.status_code < 500
        if ok and response.status_code >= 400:
            body = response.json()
            ok = set(body) == {"error"} and bool(body["error"]["message"])
        assert ok, f"{response.status_code} {response.text[:300]}\n{case.as_curl_command()}"
        fields = (*COMPILED_FIELDS, "text") if case.path == "/v1/responses" else COMPILED_FIELDS
        compiled = isinstance(case.body, dict) and any(case.body.get(f) for f in fields)
        excluded = [checks.positive_data_acceptance] if compiled else []
        if id(case) in _REWRITTEN:
            excluded.append(checks.negative_data_rejection)
        if strict:
            case.validate_response(response, checks=STRICT_CHECKS, excluded_checks=excluded)

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
