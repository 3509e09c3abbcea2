"""Twenty varied JSON schemas for structured-output tests: nested objects, arrays with bounds,
enums, numbers with ranges, unicode strings, optional fields, anyOf, const, patterns. Strings
carry a maxLength so that a model that knows no JSON still closes them."""

from __future__ import annotations

_S = {"type": "string", "maxLength": 12}

SCHEMAS: list[dict] = [
    # 1 flat object, all required
    {
        "type": "object",
        "properties": {"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    # 2 enum of unicode strings
    {"type": "string", "enum": ["café", "naïve", "日本語", "Ωmega", "plain"]},
    # 3 array with bounds
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    # 4 nested objects
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "email": _S,
                },
                "required": ["id", "email"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    # 5 optional fields
    {
        "type": "object",
        "properties": {
            "title": _S,
            "subtitle": _S,
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    # 6 number with exclusive bounds
    {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    # 7 array of objects
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "maxLength": 6},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
    # 8 const and boolean
    {
        "type": "object",
        "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"],
        "additionalProperties": False,
    },
    # 9 string pattern
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    # 10 anyOf
    {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 99},
            {"type": "string", "enum": ["none"]},
        ]
    },
    # 11 nullable field
    {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["note"],
        "additionalProperties": False,
    },
    # 12 enum of integers in an object
    {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3]}, "label": {"enum": ["low", "mid", "high"]}},
        "required": ["level", "label"],
        "additionalProperties": False,
    },
    # 13 nested arrays
    {
        "type": "array",
        "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
        "minItems": 1,
        "maxItems": 2,
    },
    # 14 unicode free string with bounds
    {"type": "string", "minLength": 1, "maxLength": 8},
    # 15 three levels deep
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    # 16 array of enums with unique-ish bounds
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    # 17 numbers: integer and float fields with ranges
    {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "y": {"type": "integer", "minimum": 100, "maximum": 200},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    # 18 $defs / $ref
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    # 19 boolean alone
    {"type": "boolean"},
    # 20 object with an optional array and a unicode enum
    {
        "type": "object",
        "properties": {
            "city": {"enum": ["Zürich", "São Paulo", "Kraków"]},
            "zips": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[0-9]{4}$"},
                "maxItems": 2,
            },
        },
        "required": ["city"],
        "additionalProperties": False,
    },
]

assert len(SCHEMAS) == 20
