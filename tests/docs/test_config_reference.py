"""docs/config.md documents every key the config loader accepts, with its type, default and meaning.

Independent of the generator (``ds_strategy.config.docgen``): this test reads the committed markdown
back into ``section -> key -> row`` and walks the JSON Schema itself, including the per-type
``optimizer.params`` / ``scheduler.params`` that only ``allOf``/``if``/``then`` clauses declare, so a key
the generator skipped, a wrong default or a missing description fails here. It also checks the other
direction (no documented key the schema lacks), the tolerated legacy forms, and the worked example.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ds_strategy.config import load_config, load_schema
from ds_strategy.config.docgen import EXAMPLE_CONFIG
from ds_strategy.config.normalize import LEGACY_FORMS
from ds_strategy.config.schema import describe, resolve

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
TOP = "(top level)"
IGNORED = "(ignored sections)"

_HEADING = re.compile(r"^#{2,3} (?P<title>.+)$")
_SECTION = re.compile(r"^`(?P<path>[^`]+)`(?: for (?P<types>.+))?$")
_ROW = re.compile(r"^\| `(?P<key>[^`]+)` \|(?P<rest>.*)\|$")


@dataclass(frozen=True)
class Row:
    accepts: str
    default: str
    description: str


def _cells(rest: str) -> list[str]:
    # Split on pipes that the generator did not escape.
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", rest)]


def parse_reference(text: str) -> dict[str, dict[str, Row]]:
    """Section -> key -> row. Sections are dotted paths (``zero_optimization.offload_optimizer``),
    ``optimizer.params[AdamW]`` for per-type params, TOP and IGNORED."""
    sections: dict[str, dict[str, Row]] = {}
    current: list[str] = []
    for line in text.splitlines():
        heading = _HEADING.match(line)
        if heading:
            title = heading.group("title")
            section = _SECTION.match(title)
            if title == "Top level":
                current = [TOP]
            elif title == "Accepted, ignored sections":
                current = [IGNORED]
            elif section and section.group("types"):
                types = re.findall(r"`([^`]+)`", section.group("types"))
                current = [f"{section.group('path')}[{t}]" for t in types]
            elif section:
                current = [section.group("path")]
            else:
                current = []
            continue
        row = _ROW.match(line)
        if row and current:
            cells = _cells(row.group("rest"))
            entry = Row(*cells[:3]) if len(cells) >= 3 else Row("", "", cells[0])
            for name in current:
                sections.setdefault(name, {})[row.group("key")] = entry
    return sections


def schema_keys() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(section, key, resolved node) of every key the loader validates, as config.md should list it."""
    top = resolve(load_schema())
    for key, prop in top["properties"].items():
        node = resolve(prop)
        if node.get("x-ignored") and node.get("type") == "object":
            yield IGNORED, key, node  # accepted, not validated: listed with what it configures in DeepSpeed
        elif "properties" in node:
            yield TOP, key, node
            yield from _walk(key, node)
        else:
            yield TOP, key, node


def _walk(path: str, node: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for key, prop in node.get("properties", {}).items():
        child = resolve(prop)
        yield path, key, child
        if "properties" in child and not child.get("x-ignored"):
            yield from _walk(f"{path}.{key}", child)
    for clause in node.get("allOf", []):
        condition = clause["if"]["properties"]["type"]
        types = condition.get("enum", [condition.get("const")])
        for owner_key, owner_prop in clause.get("then", {}).get("properties", {}).items():
            params = resolve(owner_prop)
            for type_name in types:
                for key, prop in params.get("properties", {}).items():
                    yield f"{path}.{owner_key}[{type_name}]", key, resolve(prop)


SECTIONS = parse_reference(DOC.read_text(encoding="utf-8"))
KEYS = list(schema_keys())


def test_the_walk_sees_nested_and_per_type_keys() -> None:
    # A walk that silently stopped early would make the tests below vacuous.
    found = {f"{s}.{k}" for s, k, _ in KEYS}
    for expected in (
        "zero_optimization.stage",
        "zero_optimization.offload_optimizer.device",
        "optimizer.params[AdamW].lr",
        "scheduler.params[WarmupDecayLR].total_num_steps",
    ):
        assert expected in found
    assert len(KEYS) > 150


@pytest.mark.parametrize("section,key,node", KEYS, ids=[f"{s}.{k}" for s, k, _ in KEYS])
def test_every_schema_key_is_documented(section: str, key: str, node: dict[str, Any]) -> None:
    rows = SECTIONS.get(section)
    if section == TOP and "properties" in node:
        # A top-level section is documented by its own heading and table.
        assert key in SECTIONS, f"config.md has no section for `{key}`"
        return
    assert rows is not None, f"config.md has no section `{section}`"
    assert key in rows, f"config.md does not document `{section}.{key}`"
    row = rows[key]
    assert row.description, f"`{section}.{key}` has no description"
    if section == IGNORED:
        return
    expected_type = "an object" if "properties" in node else describe(node)
    assert row.accepts == expected_type, f"`{section}.{key}`: documented type {row.accepts!r}, schema {expected_type!r}"
    if "default" in node:
        assert f"`{json.dumps(node['default'])}`" in row.default, f"`{section}.{key}`: default missing or wrong"
    else:
        assert row.default == "", f"`{section}.{key}` documents a default the schema does not have"


def test_every_documented_key_exists() -> None:
    known = {(s, k) for s, k, _ in KEYS}
    extra = [f"{s}.{k}" for s, rows in SECTIONS.items() for k in rows if (s, k) not in known]
    assert not extra, f"config.md documents keys the schema does not accept: {extra}"


def test_legacy_forms_are_documented() -> None:
    text = DOC.read_text(encoding="utf-8").replace("\\|", "|")
    for form in LEGACY_FORMS:
        assert form.old in text and form.new in text, form


def test_the_example_is_a_complete_valid_config() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ignored keys, no legacy forms
        config = load_config(EXAMPLE_CONFIG, world_size=8)
    assert config.batch.gradient_accumulation_steps == 2
    assert json.dumps(EXAMPLE_CONFIG, indent=2) in DOC.read_text(encoding="utf-8")
