"""The package's import graph: no cycle between modules, no import running upward across the layers.

Every ``import`` of a ds_strategy module counts, also inside functions and under ``TYPE_CHECKING``: a lazy
or type-only import is still a dependency, and a cycle through one is a seam that leaks (issue 19). The
layers are those of DESIGN.md / docs/architecture.md, bottom first; a module imports its own layer or
lower ones. Imports inside one top-level area (``runtime.engine`` -> ``runtime.zero``) are within a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# prefix -> (layer, why it sits there); the longest matching prefix wins.
LAYERS: dict[str, tuple[int, str]] = {
    "ds_strategy._version": (0, "the version string: readable from anywhere"),
    "ds_strategy.env": (0, "the environment variables the package reads, declared once"),
    "ds_strategy.log": (0, "logging helpers, no torch"),
    "ds_strategy.table": (0, "rich tables for summaries, no torch"),
    "ds_strategy.scheduler_env": (0, "MPI / SLURM / Azure ML variables -> ranks, torch-free (comm and launcher)"),
    "ds_strategy.ops": (0, "kernels: build/load, wrappers, fallbacks"),
    "ds_strategy.accelerator": (1, "device kind, memory stats, the device-strict mode"),
    "ds_strategy.config": (1, "the typed DeepSpeed config (no torch at import)"),
    "ds_strategy.comm": (2, "process group, collectives, shared memory"),
    "ds_strategy.launcher": (2, "ds-launch: starts processes, reads the scheduler's environment"),
    "ds_strategy.profiling": (2, "flops profiler, peak-flops table, throughput: torch only, under the engine"),
    "ds_strategy.runtime": (3, "the engine, the ZeRO stages, checkpoints"),
    "ds_strategy.zero": (3, "the public ds_strategy.zero namespace of runtime.zero"),
    "ds_strategy.pipe": (3, "the public ds_strategy.pipe namespace of runtime.pipe (pipeline parallelism)"),
    "ds_strategy.moe": (3, "the public ds_strategy.moe namespace of runtime.moe (mixture of experts)"),
    "ds_strategy.checkpointing": (3, "the public ds_strategy.checkpointing namespace (activation checkpointing)"),
    "ds_strategy.sequence": (3, "Ulysses sequence parallelism: torch and comm only, under the engine"),
    "ds_strategy.autotuning": (4, "the autotuner: runs engines in-process, trial after trial"),
    "ds_strategy.lightning": (4, "the Lightning adapter over the engine (and the autotuner's Lightning face)"),
    "ds_strategy.demo": (5, "the main job: runs the adapter"),
    "ds_strategy.report": (5, "environment report: asks every layer"),
    "ds_strategy._lightning_hook": (5, "registers the Lightning names when Lightning is imported"),
    "ds_strategy": (6, "the package: lazy re-exports of the public API"),
}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted((SRC / "ds_strategy").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imports() -> dict[str, dict[str, int]]:
    """module -> {imported ds_strategy module: first line}."""
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_package) in modules.items():
        package = module if is_package else module.rpartition(".")[0]
        found: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                # "from pkg import sub" imports the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                resolved = known(target) if target.startswith("ds_strategy") else None
                if resolved is not None and resolved != module:
                    found.setdefault(resolved, node.lineno)
        graph[module] = found
    return graph


def _layer(module: str) -> tuple[str, int]:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return best, LAYERS[best][0]


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer() -> None:
    for module in _modules():
        assert any(module == p or module.startswith(p + ".") for p in LAYERS), module


def test_no_import_cycle() -> None:
    graph = _imports()
    problems = []
    for component in _cycles(graph):
        members = set(component)
        links = [
            f"{m} -> {t} ({_modules()[m][0].relative_to(SRC)}:{line})"
            for m in component
            for t, line in graph[m].items()
            if t in members
        ]
        problems.append("cycle between " + ", ".join(component) + ":\n    " + "\n    ".join(links))
    assert not problems, "\n".join(problems)


def test_no_upward_import() -> None:
    graph = _imports()
    modules = _modules()
    problems = []
    for module, targets in graph.items():
        area, level = _layer(module)
        for target, line in targets.items():
            target_area, target_level = _layer(target)
            if target_level > level:
                problems.append(
                    f"{modules[module][0].relative_to(SRC)}:{line}: {module} ({area}, layer {level}) imports "
                    f"{target} ({target_area}, layer {target_level})"
                )
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_the_walker_counts_lazy_imports_and_finds_cycles() -> None:
    """The checks see what they must: a function-level import (engine.save_checkpoint imports the
    checkpoint package inside the method) is an edge, and a two-module loop is reported."""
    graph = _imports()
    assert "ds_strategy.runtime.checkpoint" in graph["ds_strategy.runtime.engine"]
    assert _cycles({"a": {"b": 1}, "b": {"a": 2}, "c": {"a": 3}}) == [["a", "b"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


def test_the_scheduler_environment_is_read_without_torch() -> None:
    """scheduler_env.py serves init_distributed and the launcher's bootstrap: it must not import torch."""
    import subprocess
    import sys

    code = "import sys, ds_strategy.scheduler_env; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _child_graphs(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, dict[str, tuple[str, str, int]]]]:
    """package -> {child: {other child: (module, imported module, line)}}: the import graph seen from each
    package, every module collapsed into the child of that package it lies in (a sub-package or a module)."""
    modules = _modules()
    packages = {m for m, (_, is_package) in modules.items() if is_package}
    out: dict[str, dict[str, dict[str, tuple[str, str, int]]]] = {}
    for package in packages:

        def child(module: str, package: str = package) -> str | None:
            if not module.startswith(package + "."):
                return None
            return package + "." + module[len(package) + 1 :].split(".")[0]

        edges: dict[str, dict[str, tuple[str, str, int]]] = {}
        for module, targets in graph.items():
            a = child(module)
            for target, line in targets.items():
                b = child(target)
                if a is not None and b is not None and a != b:
                    edges.setdefault(a, {}).setdefault(b, (module, target, line))
        out[package] = edges
    return out


def test_no_cycle_between_sub_packages() -> None:
    """Seen from every package, its sub-packages and modules import each other without a loop (issue 43):
    ``runtime.zero`` -> ``runtime.swap`` -> ``runtime.zero`` is a seam that leaks, even when no two modules
    form a cycle (a module-level cycle test misses it)."""
    problems = []
    for package, edges in sorted(_child_graphs(_imports()).items()):
        flat = {a: dict.fromkeys(bs, 0) for a, bs in edges.items()}
        for component in _cycles(flat):
            members = set(component)
            links = [
                f"{m} -> {t} ({_modules()[m][0].relative_to(SRC)}:{line})"
                for a in component
                for b, (m, t, line) in edges.get(a, {}).items()
                if b in members
            ]
            problems.append(f"in {package}: cycle between " + ", ".join(component) + ":\n    " + "\n    ".join(links))
    assert not problems, "\n".join(problems)
