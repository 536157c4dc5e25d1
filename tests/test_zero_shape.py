"""The shape of runtime/zero (issue 43, criterion 1): objects with one job each, none reaching into another.

- No class there has more than 25 methods (properties and class methods count): ``ZeroStage`` once held
  storage, hook wiring, three norm variants, the optimizer step, residency and the reduction schedule in
  61 methods; those are now the intake, the reducer, the step, the norm and the placement.
- No module there reads or writes another object's underscore attribute (``other._x``): objects talk
  through public names or small protocols. Torch's own underscore API (``module._parameters``,
  ``tensor._version``, ``torch._foreach_mul_``) is torch's documented-by-use surface, not our objects.
"""

from __future__ import annotations

import ast
from pathlib import Path

ZERO = Path(__file__).resolve().parents[1] / "src" / "ds_strategy" / "runtime" / "zero"
MAX_METHODS = 25
# torch._assert_async: the only check that raises without a host read (a device assert on a GPU).
TORCH_PRIVATE = {"_parameters", "_version", "_getframe", "_forward_pre_hooks", "_forward_hooks", "_assert_async"}


def _trees() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(), filename=str(p)) for p in sorted(ZERO.glob("*.py"))}


def test_no_class_in_runtime_zero_has_more_than_25_methods() -> None:
    counts = {
        f"{name}:{node.name}": sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in node.body)
        for name, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    assert counts, "no class found: wrong path?"
    too_many = {k: n for k, n in counts.items() if n > MAX_METHODS}
    assert not too_many, f"classes over {MAX_METHODS} methods: {too_many}"


def _foreign_private(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or attr.startswith("__") or attr in TORCH_PRIVATE:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in {"self", "cls"}:
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            continue  # the object's own attribute, through its base class
        if isinstance(base, ast.Name) and base.id == "torch" and attr.startswith("_foreach_"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_in_runtime_zero_reaches_into_another_objects_privates() -> None:
    problems = [f"{name}:{line}: {text}" for name, tree in _trees().items() for line, text in _foreign_private(tree)]
    assert not problems, "underscore attributes of other objects:\n" + "\n".join(problems)


def test_the_private_access_check_finds_a_reach() -> None:
    tree = ast.parse("def f(stage):\n    return stage._staging, self._mine, super()._own, torch._foreach_add_\n")
    assert _foreign_private(tree) == [(2, "stage._staging")]
