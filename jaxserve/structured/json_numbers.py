"""JSON numbers a schema leaves unbounded, bounded so forced JSON finishes (#39).

A weak model constrained to ``{"type": "integer"}`` may write digits until ``max_tokens``
(``"celsius": 1975599377109515522892773...``). :func:`bound_numbers` gives such numbers what
JSON consumers accept: a schema's ``integer`` without bounds gets int64's (``INT_BOUND``), a
``number`` without bounds gets ``FLOAT_BOUND`` and without ``multipleOf`` ``FLOAT_DECIMALS``
decimals; ``json_object`` gets an any-JSON schema whose numbers are bounded the same way. On
by default (``--structured-outputs-bounded-numbers``); a request turns it off with
``structured_outputs.bounded_numbers: false`` or ``"x-guidance": {"bounded_numbers": false}``
at the top of its schema (:func:`schema_and_bounding` reads both).
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.sampling_params import StructuredOutputsParams
from jaxserve.structured.threads import yield_gil

INT_BOUND = 2**63 - 1024
"""Bound put on JSON integers a schema leaves unbounded: |n| <= 2**63 - 1024, inside int64
(llguidance reads bounds as doubles, and 2**63 - 1 would round out of int64)."""

FLOAT_BOUND = 1e15
"""Bound put on JSON numbers a schema leaves unbounded: |x| <= 1e15 (no exponent)."""

FLOAT_DECIMALS = 9
"""Most decimals of a JSON number whose schema has no ``multipleOf`` (``multipleOf: 1e-9``)."""


_INT_REF = {"$ref": "#/$defs/jaxserve_int"}
_NUMBER_REF = {"$ref": "#/$defs/jaxserve_number"}


def _bounded_defs() -> dict[str, Any]:
    """The ``$defs`` :func:`bound_numbers` refers to: one bounded integer, one bounded number
    and any JSON value built from them (one lexeme each, however many properties use them:
    inline bounds cost ~4 ms of compile per property, 50 tools of 8 numeric parameters 1.4 s)."""
    ref = {"$ref": "#/$defs/jaxserve_any"}
    return {
        "jaxserve_int": {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND},
        "jaxserve_number": {
            "type": "number",
            "minimum": -FLOAT_BOUND,
            "maximum": FLOAT_BOUND,
            "multipleOf": 10.0**-FLOAT_DECIMALS,
        },
        "jaxserve_any": {
            "anyOf": [
                {"type": "null"},
                {"type": "boolean"},
                _NUMBER_REF,
                {"type": "string"},
                {"type": "array", "items": ref},
                {"type": "object", "additionalProperties": ref},
            ]
        },
    }


_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else")
_ANNOTATIONS = frozenset(("type", "title", "description", "default", "examples", "$comment"))


def _bounded(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The bounded replacement of a schema whose only constraint is its ``type`` list with
    ``integer`` / ``number`` in it (refs to the shared definitions), else None."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not set(schema) <= _ANNOTATIONS:
        return None
    if "integer" not in types and "number" not in types:
        return None
    parts: list[dict[str, Any]] = []
    for t in dict.fromkeys(types):
        if t == "integer":
            parts.append(dict(_INT_REF))
        elif t == "number":
            parts.append(dict(_NUMBER_REF))
        elif isinstance(t, str):
            parts.append({"type": t})
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _bound_inline(schema: dict[str, Any]) -> None:
    """Adds the missing bounds to a numeric schema that has other constraints too."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    has_min = "minimum" in schema or "exclusiveMinimum" in schema
    has_max = "maximum" in schema or "exclusiveMaximum" in schema
    if "number" in types:
        bound = FLOAT_BOUND
        if "multipleOf" not in schema:
            schema["multipleOf"] = 10.0**-FLOAT_DECIMALS
    elif "integer" in types:
        bound = INT_BOUND
    else:
        return
    if not has_min:
        schema["minimum"] = -bound
    if not has_max:
        schema["maximum"] = bound


def _bound_in_place(schema: Any, depth: int = 0) -> Any:
    """``schema`` with its numbers bounded (changed in place where it can be; returns the
    schema to use in its place)."""
    if not isinstance(schema, dict) or depth > 256:
        return schema
    if depth == 2:  # each property / item / alternative of the root
        yield_gil()
    replacement = _bounded(schema)
    if replacement is not None:
        return replacement
    _bound_inline(schema)
    for key in _SUBSCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, value in sub.items():
                sub[name] = _bound_in_place(value, depth + 1)
    for key in _SUBSCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            sub[:] = [_bound_in_place(value, depth + 1) for value in sub]
    for key in _SUBSCHEMA_ONE:
        if key in schema:
            schema[key] = _bound_in_place(schema[key], depth + 1)
    return schema


def bound_numbers(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a JSON schema whose unbounded numbers are bounded: an ``integer`` without a
    minimum / maximum gets ``-INT_BOUND`` / ``INT_BOUND``, a ``number`` ``-FLOAT_BOUND`` /
    ``FLOAT_BOUND`` and, without ``multipleOf``, ``multipleOf: 1e-FLOAT_DECIMALS``. A schema
    that is only its type becomes a ``$ref`` to one shared bounded definition (``$defs``
    ``jaxserve_int`` / ``jaxserve_number``, added at the root). Bounds the schema sets are kept.
    Free-form values (``{}``, undeclared properties) are left alone."""
    out = _bound_in_place(json.loads(json.dumps(schema)))  # a copy, at C speed
    if not isinstance(out, dict):
        return out
    defs = out.get("$defs")
    out["$defs"] = {**(defs if isinstance(defs, dict) else {}), **_bounded_defs()}
    return out


def schema_and_bounding(spec: StructuredOutputsParams, default: bool) -> tuple[Any, bool]:
    """The JSON schema of a json / json_object constraint (our ``x-guidance`` key taken out)
    and whether its numbers are bounded."""
    bounded = default if spec.bounded_numbers is None else spec.bounded_numbers
    if spec.kind == "json_object":
        if not bounded:
            return {"type": "object"}, False
        return {
            "$defs": _bounded_defs(),
            "type": "object",
            "additionalProperties": {"$ref": "#/$defs/jaxserve_any"},
        }, True
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if isinstance(schema, dict) and isinstance(schema.get("x-guidance"), dict):
        options = dict(schema["x-guidance"])
        if "bounded_numbers" in options:
            flag = options.pop("bounded_numbers")
            if not isinstance(flag, bool):
                raise ValueError("x-guidance.bounded_numbers must be a boolean")
            if spec.bounded_numbers is None:
                bounded = flag
            schema = {**schema, "x-guidance": options}
            if not options:
                del schema["x-guidance"]
    if bounded and isinstance(schema, dict):
        schema = bound_numbers(schema)
    return schema, bounded
