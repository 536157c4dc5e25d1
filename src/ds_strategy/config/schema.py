"""The shipped JSON Schema (Draft 2020-12) and everything driven by it.

The schema is the single source of truth for which keys exist, their types, their defaults and their
descriptions. This module loads it and walks it alongside a config to:

- coerce the scalar spellings DeepSpeed tolerates (``"true"`` for ``true``, ``3e8`` for an integer,
  case-insensitive enum names and aliases) before validation,
- validate and turn every ``jsonschema`` error into a ``ConfigProblem`` that names the path, the value
  and what would be valid (with a did-you-mean for unknown keys and enum values),
- fill in defaults.

Schema extensions (ignored by ``jsonschema``): ``x-ignored`` marks well-known DeepSpeed keys that are
accepted but not acted on; ``x-aliases`` maps lower-case alternative spellings to an enum value;
``x-auto`` says how an ``"auto"`` value is resolved (used by the docs).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator, Mapping
from importlib import resources
from typing import Any

from jsonschema import Draft202012Validator, ValidationError

from .errors import ConfigProblem, did_you_mean, format_value, join_path, json_type_name, path_of

SCHEMA_FILE = "ds_config.schema.json"

Schema = Mapping[str, Any]


@functools.cache
def load_schema() -> dict[str, Any]:
    """The parsed schema. Cached and shared: treat it as read-only."""
    text = resources.files(__package__).joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@functools.cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(load_schema())


@functools.cache
def _sub_validator(if_schema_json: str) -> Draft202012Validator:
    # ``if`` sub-schemas are small and self-contained (no $ref); cache one validator per distinct one.
    return Draft202012Validator(json.loads(if_schema_json))


def resolve(node: Schema) -> dict[str, Any]:
    """Follow local ``$ref`` chains; sibling keywords (description, default ...) override the target."""
    merged: dict[str, Any] = {}
    seen: list[Schema] = []
    current: Schema = node
    while True:
        seen.append(current)
        ref = current.get("$ref")
        if ref is None:
            break
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"schema uses an unsupported $ref: {ref}")
        current = load_schema()["$defs"][ref.removeprefix("#/$defs/")]
    for part in reversed(seen):
        merged.update({k: v for k, v in part.items() if k != "$ref"})
    return merged


def branches(node: Schema) -> list[dict[str, Any]]:
    """The alternatives of a node: its ``anyOf`` / ``oneOf`` branches (resolved), or the node itself."""
    node = resolve(node)
    alts = node.get("anyOf") or node.get("oneOf")
    if not alts:
        return [node]
    out: list[dict[str, Any]] = []
    for alt in alts:
        out.extend(branches(alt))
    return out


def properties(node: Schema) -> dict[str, Any]:
    return dict(resolve(node).get("properties", {}))


def child_schema(node: Schema, key: str, instance: Mapping[str, Any]) -> dict[str, Any] | None:
    """Schema of ``instance[key]`` where ``instance`` is validated by ``node``.

    Honours ``allOf: [{if, then}]`` (per-type optimizer and scheduler params) by evaluating each ``if``
    against ``instance``; returns None for keys the schema does not know.
    """
    node = resolve(node)
    found: dict[str, Any] | None = None
    props = node.get("properties", {})
    if key in props:
        found = resolve(props[key])
    for clause in node.get("allOf", []):
        then = clause.get("then", {}).get("properties", {})
        if key in then and _sub_validator(json.dumps(clause["if"], sort_keys=True)).is_valid(instance):
            found = {**(found or {}), **resolve(then[key])}
    return found


def is_ignored(node: Schema) -> bool:
    return bool(resolve(node).get("x-ignored", False))


def iter_types(node: Schema) -> set[str]:
    """JSON types a node admits (``const`` / ``enum`` values count by their own type)."""
    types: set[str] = set()
    for alt in branches(node):
        t = alt.get("type")
        if isinstance(t, str):
            types.add(t)
        elif isinstance(t, list):
            types.update(t)
        for value in alt.get("enum", []) + ([alt["const"]] if "const" in alt else []):
            types.add(json_type_name(value))
    return types


# --------------------------------------------------------------------------------------------------
# Coercion of tolerated scalar spellings


def coerce(instance: Any, node: Schema) -> Any:
    """Return ``instance`` with tolerated scalar spellings rewritten to the canonical JSON value.

    Only rewrites what is unambiguous under the schema: a string ``"true"``/``"false"`` where a boolean
    is expected, an integral float (``3e8``) where only an integer is, a 0/1 integer where only a
    boolean is, and enum names differing only in case or listed in ``x-aliases``. Anything else is left
    for validation to report.
    """
    node = resolve(node)
    if isinstance(instance, dict):
        # Scalars first: ``if`` clauses that pick a child schema (optimizer type -> params) must see
        # the canonical spelling of their discriminator.
        keys = sorted(instance, key=lambda k: isinstance(instance[k], (dict, list)))
        for key in keys:
            child = child_schema(node, key, instance)
            if child is not None:
                instance[key] = coerce(instance[key], child)
        return instance
    if isinstance(instance, list):
        alts = [a for a in branches(node) if "items" in a]
        if alts:
            return [coerce(v, alts[0]["items"]) for v in instance]
        return instance
    return _coerce_scalar(instance, node)


def _coerce_scalar(value: Any, node: Schema) -> Any:
    alts = branches(node)
    types = iter_types(node)
    if _accepted_as_is(value, alts):
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        if "boolean" in types and lowered in ("true", "false"):
            return lowered == "true"
        for alt in alts:
            choices = alt.get("enum", []) + ([alt["const"]] if "const" in alt else [])
            by_case = {c.lower(): c for c in choices if isinstance(c, str)}
            if lowered in by_case:
                return by_case[lowered]
            aliases = alt.get("x-aliases", {})
            if lowered in aliases:
                return aliases[lowered]
        return value
    if isinstance(value, float) and value.is_integer() and "integer" in types and "number" not in types:
        return int(value)
    if type(value) is int and value in (0, 1) and types & {"boolean"} and not types & {"integer", "number"}:
        return bool(value)
    return value


def _accepted_as_is(value: Any, alts: list[dict[str, Any]]) -> bool:
    for alt in alts:
        if "const" in alt and alt["const"] == value and type(alt["const"]) is type(value):
            return True
        if any(v == value and type(v) is type(value) for v in alt.get("enum", [])):
            return True
    return False


# --------------------------------------------------------------------------------------------------
# Defaults


def fill_defaults(instance: dict[str, Any], node: Schema) -> dict[str, Any]:
    """Fill missing keys that have a ``default`` (recursively); create absent sub-sections.

    Keys marked ``x-ignored`` are never filled: they only exist when the user wrote them.
    """
    node = resolve(node)
    for key, prop in node.get("properties", {}).items():
        if key in instance:
            continue
        child = child_schema(node, key, instance) or resolve(prop)
        if child.get("x-ignored"):  # only present when the user wrote it
            continue
        if "default" in child:
            instance[key] = copy.deepcopy(child["default"])
        elif "properties" in child:
            instance[key] = {}
    for key, value in instance.items():
        sub = child_schema(node, key, instance)
        if sub is not None and isinstance(value, dict) and not sub.get("x-ignored"):
            fill_defaults(value, sub)
    return instance


# --------------------------------------------------------------------------------------------------
# Validation and error messages


def validate(instance: Any) -> list[ConfigProblem]:
    """Every schema violation of ``instance`` as a readable problem, in document order."""
    errors = sorted(_validator().iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path])
    problems: list[ConfigProblem] = []
    for error in errors:
        for problem in _problems_of(error):
            if problem not in problems:
                problems.append(problem)
    return problems


def _problems_of(error: ValidationError) -> list[ConfigProblem]:
    path = path_of(error.absolute_path)
    kind = error.validator
    value = error.instance
    if kind == "additionalProperties" and isinstance(value, dict):
        known = sorted(error.schema.get("properties", {}))
        return [
            ConfigProblem(join_path(path, key), _unknown_key_message(key, known))
            for key in value
            if key not in error.schema.get("properties", {})
        ]
    if kind == "required" and isinstance(value, dict):
        return [
            ConfigProblem(join_path(path, key), "is required here but missing")
            for key in error.validator_value
            if key not in value
        ]
    if kind in ("anyOf", "oneOf"):
        # Prefer the complaint of the branch whose type matches the value ("must be >= 1" beats
        # "expected an integer >= 1 or \"auto\"" for a 0).
        actual = json_type_name(value)
        for index, alt in enumerate(error.validator_value):
            alt_types = iter_types(alt)
            if actual in alt_types or (actual == "integer" and "number" in alt_types):
                sub = [e for e in error.context or [] if e.schema_path and e.schema_path[0] == index]
                if sub and all(e.validator not in ("type", "const", "enum") for e in sub):
                    return [p for e in sub for p in _problems_of(e)]
        return [ConfigProblem(path, f"got {_shown(value)}; expected {describe(error.schema)}")]
    if kind in ("enum", "const"):
        choices = error.validator_value if kind == "enum" else [error.validator_value]
        hint = did_you_mean(value, [c for c in choices if isinstance(c, str)]) if isinstance(value, str) else ""
        return [
            ConfigProblem(
                path, f"got {_shown(value)}; expected {describe(error.schema)}" + (f"; {hint}" if hint else "")
            )
        ]
    if kind in ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems"):
        return [ConfigProblem(path, f"got {_shown(value)}; expected {describe(error.schema)}")]
    return [ConfigProblem(path, f"{error.message} (got {_shown(value)})")]


def _unknown_key_message(key: str, known: list[str]) -> str:
    hint = did_you_mean(key, known)
    if hint:
        return f"unknown key; {hint}"
    if len(known) <= 16:
        return "unknown key; valid keys here: " + ", ".join(known)
    return "unknown key; see docs/config.md for the valid keys"


def _shown(value: Any) -> str:
    kind = json_type_name(value)
    text = format_value(value)
    return text if kind in ("integer", "number", "boolean", "null") else f"{text} ({kind})"


def describe(node: Schema) -> str:
    """What a schema node accepts, in words: ``an integer >= 1 or "auto"``."""
    parts: list[str] = []
    for alt in branches(node):
        for text in _describe_one(alt):
            if text not in parts:
                parts.append(text)
    if not parts:
        return "any value"
    return " or ".join(parts)


def _describe_one(node: dict[str, Any]) -> list[str]:
    if "const" in node:
        return [json.dumps(node["const"])]
    if "enum" in node:
        return ["one of " + ", ".join(json.dumps(v) for v in node["enum"])]
    raw = node.get("type")
    types = [raw] if isinstance(raw, str) else list(raw or [])
    out: list[str] = []
    for t in types:
        if t in ("integer", "number"):
            out.append(("an integer" if t == "integer" else "a number") + _bounds(node))
        elif t == "boolean":
            out.append("a boolean")
        elif t == "string":
            out.append("a string")
        elif t == "null":
            out.append("null")
        elif t == "array":
            out.append(_describe_array(node))
        elif t == "object":
            out.append("an object")
    return out


def _bounds(node: Mapping[str, Any]) -> str:
    parts = []
    for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in node:
            parts.append(f"{op} {node[key]}")
    return (" " + " and ".join(parts)) if parts else ""


def _describe_array(node: Mapping[str, Any]) -> str:
    lo, hi = node.get("minItems"), node.get("maxItems")
    items = node.get("items")
    noun = _plural(describe(items)) if items else "items"
    if lo is not None and lo == hi:
        return f"an array of {lo} {noun}"
    return f"an array of {noun}"


def _plural(text: str) -> str:
    for article in ("an ", "a "):
        if text.startswith(article):
            noun, _, rest = text[len(article) :].partition(" ")
            return f"{noun}s {rest}".strip()
    return text


def walk_properties(node: Schema, path: str = "") -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(dotted path, key, resolved schema) of every property in document order, depth first."""
    for key, prop in resolve(node).get("properties", {}).items():
        child = resolve(prop)
        full = join_path(path, key)
        yield full, key, child
        if not child.get("x-ignored"):
            yield from walk_properties(child, full)
