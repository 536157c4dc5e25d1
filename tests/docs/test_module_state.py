"""docs/architecture.md lists the module-level state of the package (issue 42, criterion 4): every module-level
name the package changes after import, found here by reading the source, must be in the page's "Module-level
state" table, and every name the table lists must still be such state.

What counts (per module, by its AST): a name a function rebinds through ``global``; a module-level name a
function mutates (an item or attribute assignment, ``del name[...]``, or a call of a mutating method:
append, add, update, setdefault, pop, ...); a module-level name bound to a ``threading.local``, a weak
container, or a module-level function decorated with ``functools.cache`` / ``lru_cache``; a write to
``globals()``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "ds_strategy"
DOC = REPO / "docs" / "architecture.md"

MUTATORS = {
    "append", "add", "update", "pop", "clear", "setdefault", "extend", "insert", "remove", "discard", "popitem",
    "appendleft", "popleft", "__setitem__", "__delitem__",
}  # fmt: skip
STATEFUL_TYPES = ("local", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "Counter", "deque")
CACHES = ("cache", "lru_cache")


def _module_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _callee(node: ast.expr) -> str:
    while isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def module_state(source: str) -> set[str]:
    """The module-level state of one module's source (see the module docstring)."""
    tree = ast.parse(source)
    top = _module_names(tree)
    found: set[str] = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if value is not None and isinstance(value, ast.Call) and _callee(value) in STATEFUL_TYPES:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]  # type: ignore[union-attr]
            found |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            _callee(d) in CACHES for d in node.decorator_list
        ):
            found.add(node.name)
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Global):
                found |= set(n.names)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS:
                if isinstance(n.func.value, ast.Name) and n.func.value.id in top:
                    found.add(n.func.value.id)
            elif isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]
                for t in targets:
                    base = t.value if isinstance(t, (ast.Subscript, ast.Attribute)) else None
                    if isinstance(base, ast.Name) and base.id in top:
                        found.add(base.id)
                    if isinstance(t, ast.Subscript) and isinstance(base, ast.Call) and _callee(base) == "globals":
                        found.add("globals()")
    return found


def package_state() -> dict[str, set[str]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        names = module_state(path.read_text())
        if names:
            out[path.relative_to(SRC).as_posix()] = names
    return out


def documented() -> dict[str, set[str]]:
    """The table of docs/architecture.md's "Module-level state" section: module -> names."""
    text = DOC.read_text()
    match = re.search(r"^## Module-level state\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert match, "docs/architecture.md has no '## Module-level state' section"
    out: dict[str, set[str]] = {}
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        out[cells[0].strip("`")] = set(re.findall(r"`([^`]+)`", cells[1]))
    return out


def test_the_scan_finds_each_kind_of_state() -> None:
    source = """
import functools, threading
A = []
B = {}
C = 0
D = threading.local()
E = {"fixed": 1}
F = []
@functools.cache
def g(): return 1
def f():
    global C
    C += 1
    A.append(1)
    B["k"] = 2
    globals()["h"] = 3
    local = []
    local.append(1)
    return E["fixed"], F
"""
    assert module_state(source) == {"A", "B", "C", "D", "g", "globals()"}


def test_every_module_level_state_is_listed_in_the_architecture_doc() -> None:
    found, listed = package_state(), documented()
    # What the issue named, as a check of the scan itself.
    for module, name in (
        ("comm/ownership.py", "_records"),
        ("runtime/zero/init.py", "_originals"),
        ("runtime/zero/leaf.py", "_generation"),
        ("accelerator/strict.py", "_tagged"),
        ("ops/fake_kernels.py", "_registered"),
    ):
        assert name in found.get(module, set()), (module, name)
    missing = {m: sorted(n - listed.get(m, set())) for m, n in found.items() if n - listed.get(m, set())}
    assert not missing, (
        f"module-level state not listed in docs/architecture.md (## Module-level state): {missing}; add a row "
        "saying why it is per process, or keep the state on an object"
    )
    stale = {m: sorted(n - found.get(m, set())) for m, n in listed.items() if n - found.get(m, set())}
    assert not stale, f"docs/architecture.md lists module-level state that no longer exists: {stale}"
