"""Unknown request fields are accepted, and logged once per field name (#39, as vLLM logs
them), with a bound on the names remembered."""

from __future__ import annotations

import logging

import jaxserve.serving.endpoints as endpoints
from jaxserve.serving.endpoints import validate
from jaxserve.serving.protocol import CompletionRequest


def _logged(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "is not known to this server" in r.getMessage()
    ]


def test_unknown_fields_are_logged_once_per_name(caplog, monkeypatch):
    monkeypatch.setattr(endpoints, "_logged_unknown_fields", set())
    caplog.set_level(logging.WARNING, logger="jaxserve.serving.endpoints")
    body = {"prompt": "x", "max_tokenz": 4, "best_of_n": 2}
    request = validate(CompletionRequest, body, "/v1/completions")
    assert request.max_tokens == 16  # accepted, the misspelt field ignored
    first = _logged(caplog)
    assert len(first) == 2 and all(m.startswith("/v1/completions: ") for m in first)
    assert "'max_tokenz'" in first[0] or "'max_tokenz'" in first[1]
    validate(CompletionRequest, body, "/v1/completions")
    validate(CompletionRequest, {"prompt": "x", "max_tokenz": 1, "seed_": 3})
    assert len(_logged(caplog)) == 3  # only seed_ is new


def test_unknown_field_names_remembered_are_bounded(caplog, monkeypatch):
    monkeypatch.setattr(endpoints, "_logged_unknown_fields", set())
    monkeypatch.setattr(endpoints, "MAX_LOGGED_UNKNOWN_FIELDS", 5)
    caplog.set_level(logging.WARNING, logger="jaxserve.serving.endpoints")
    for i in range(4):
        validate(CompletionRequest, {"prompt": "x", **{f"f{i}_{j}": j for j in range(3)}})
    assert len(endpoints._logged_unknown_fields) == 5 and len(_logged(caplog)) == 5
    assert any("further ones are not" in r.getMessage() for r in caplog.records)
