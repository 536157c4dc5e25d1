"""ds_strategy/env.py: the one place the package's environment variables are declared and read (issue 19)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ds_strategy import env

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ds_strategy"
NAME = re.compile(r"^DS_(STRATEGY_[A-Z0-9_]+|ACCELERATOR)$")


def test_the_docs_page_is_generated_from_the_registry() -> None:
    page = (ROOT / "docs" / "environment.md").read_text()
    table = page.split("<!-- env-table:start -->\n", 1)[1].split("<!-- env-table:end -->", 1)[0]
    assert table == env.markdown_table(), "docs/environment.md is stale: regenerate it with python -m ds_strategy.env"


def test_no_module_names_a_variable_outside_the_registry() -> None:
    """A variable's name appears as a string constant only in env.py: every reader goes through it."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "env.py" and path.parent == PACKAGE:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            is_text = isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            if is_text and NAME.match(node.value):  # type: ignore[attr-defined]
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")  # type: ignore[attr-defined]
    assert not offenders, "declare and read these through ds_strategy/env.py:\n" + "\n".join(offenders)


def test_every_variable_the_package_mentions_is_declared() -> None:
    mentioned = set()
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "csrc").rglob("*.cpp")]:
        mentioned |= set(re.findall(r"\bDS_STRATEGY_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert mentioned <= set(env.VARIABLES), sorted(mentioned - set(env.VARIABLES))


def test_get_reads_at_call_time_and_refuses_undeclared_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.EXIT_WAIT, "7")
    assert env.get(env.EXIT_WAIT) == "7"
    monkeypatch.delenv(env.EXIT_WAIT)
    assert env.get(env.EXIT_WAIT, "300") == "300"
    with pytest.raises(KeyError, match="DS_STRATEGY_NOPE is not a declared ds_strategy environment variable"):
        env.get("DS_STRATEGY_NOPE")
