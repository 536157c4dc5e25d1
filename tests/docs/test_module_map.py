"""docs/architecture.md's module map is the code's, so the drawing cannot drift.

Every package of src/ds_strategy and every module at its top has one row in the "Module map" section: its
layer (``LAYERS`` of tests/test_architecture.py, the table the import checks use), its place, and the
modules it holds (every ``.py`` file in the package, sub-packages having rows of their own), rows ordered
from the top layer down. A module added, moved or removed, or a layer changed, fails here until the map
says so; the failure prints the rows as they should read, with the hand-written "what" column kept, ready
to paste (``python -m tests.docs.test_module_map`` prints the whole table).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_architecture import LAYERS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "ds_strategy"
DOC = ROOT / "docs" / "architecture.md"
HEADING = "## Module map"
HEADER = "| layer | where | modules | what it holds |"

Row = tuple[int, str, str]  # (layer, where, modules)


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best][0]


def code_rows() -> list[Row]:
    """The rows the code asks for: a package per row (``runtime/zero/``, its modules listed), each module
    at the package's top a row of its own (``env.py``); top layer first, then by place."""
    rows: list[Row] = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        directory = init.parent
        if directory == PACKAGE:
            continue
        rel = directory.relative_to(PACKAGE).as_posix()
        modules = sorted(p.name for p in directory.glob("*.py") if p.name != "__init__.py")
        rows.append((_layer("ds_strategy." + rel.replace("/", ".")), f"{rel}/", ", ".join(modules)))
    for path in sorted(PACKAGE.glob("*.py")):
        module = "ds_strategy" if path.stem == "__init__" else f"ds_strategy.{path.stem}"
        rows.append((_layer(module), path.name, ""))
    return sorted(rows, key=lambda r: (-r[0], r[1]))


def doc_rows(text: str | None = None) -> list[tuple[Row, str]]:
    """The map's rows in docs/architecture.md (or in ``text``): ((layer, where, modules), what)."""
    text = DOC.read_text() if text is None else text
    assert HEADING in text, f"docs/architecture.md has no {HEADING!r} section"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    assert HEADER in section, f"the module map's table header is {HEADER!r}"
    out = []
    for line in section.split(HEADER, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        layer, where, modules, what = (c.strip() for c in line.strip().strip("|").split("|"))
        out.append(((int(layer), where.strip("`"), re.sub(r"[`]", "", modules)), what))
    return out


def render(rows: list[Row], what: dict[str, str]) -> str:
    lines = [HEADER, "| --- | --- | --- | --- |"]
    for layer, where, modules in rows:
        listed = ", ".join(f"`{m}`" for m in modules.split(", ")) if modules else ""
        lines.append(f"| {layer} | `{where}` | {listed} | {what.get(where, '')} |")
    return "\n".join(lines)


def test_the_module_map_matches_the_code() -> None:
    documented = doc_rows()
    want = code_rows()
    got = [row for row, _ in documented]
    what = {row[1]: text for row, text in documented}
    assert got == want, (
        "docs/architecture.md's module map differs from src/ds_strategy; the rows should read:\n\n" + render(want, what)
    )


def test_every_row_says_what_it_holds() -> None:
    empty = [row[1] for row, what in doc_rows() if not what]
    assert not empty, f"module map rows without a 'what it holds': {empty}"


def test_the_check_sees_a_drift() -> None:
    """A map rendered from the code reads back as the code's rows; with a module dropped from a row, a layer
    changed or a row too many, it does not."""
    want = code_rows()
    page = f"# Architecture\n\n{HEADING}\n\n{render(want, {})}\n\n## Next\n"
    assert [row for row, _ in doc_rows(page)] == want
    lightning = render([r for r in want if r[1] == "lightning/"], {}).splitlines()[-1]
    assert "`core.py`, " in lightning and lightning.startswith("| 4 |")
    for drifted in (
        page.replace(lightning, lightning.replace("`core.py`, ", "")),
        page.replace(lightning, lightning.replace("| 4 |", "| 3 |", 1)),
        page.replace("\n\n## Next", "\n| 0 | `gone.py` |  | removed |\n\n## Next"),
    ):
        assert drifted != page and [row for row, _ in doc_rows(drifted)] != want


if __name__ == "__main__":
    print(render(code_rows(), {row[1]: what for row, what in doc_rows()} if HEADING in DOC.read_text() else {}))
