"""docs/config.md is generated from the schema and must be regenerated whenever the schema changes."""

from __future__ import annotations

from ds_strategy.config import load_schema
from ds_strategy.config.docgen import REGENERATE, main, render_markdown
from ds_strategy.config.schema import walk_properties

from .helpers import REPO_ROOT

DOC = REPO_ROOT / "docs" / "config.md"


def test_docs_config_md_is_fresh() -> None:
    current = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    assert current == render_markdown(), f"docs/config.md is stale; regenerate it with: {REGENERATE}"


def test_docs_list_every_key_and_every_default() -> None:
    text = render_markdown()
    for path, key, node in walk_properties(load_schema()):
        assert f"`{key}`" in text, path
        if "default" in node:
            assert f"`{__import__('json').dumps(node['default'])}`" in text, path


def test_docgen_writes_a_file(tmp_path: object) -> None:
    from pathlib import Path

    out = Path(str(tmp_path)) / "config.md"
    assert main(["--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render_markdown()
