"""The printed flops profile: a summary, the top module types per depth, and a per-module table."""

from __future__ import annotations

from typing import Any, Protocol, TextIO

from torch import nn

from ds_strategy.table import print_table

from .units import duration_to_string, flops_to_string, macs_to_string, number_to_string, params_to_string


class Profile(Protocol):
    """What the tables read: FlopsProfiler's totals and per-module numbers."""

    model: nn.Module
    ds_engine: Any
    recompute_fwd_factor: float

    def get_total_flops(self, as_string: bool = False) -> int | str: ...
    def get_total_duration(self, as_string: bool = False) -> float | str: ...
    def get_total_params(self, as_string: bool = False) -> int | str: ...
    def module_flops(self, module: nn.Module) -> int: ...
    def module_duration(self, module: nn.Module) -> float: ...
    def module_params(self, module: nn.Module) -> int: ...


_WIDTH = 160  # rich wraps to 80 columns in files and pipes: a module table needs more


def render_profile(
    prof: Profile, file: TextIO | None, profile_step: int, module_depth: int, top_modules: int, detailed: bool
) -> None:
    print_table(f"Flops profile at step {profile_step}", ("quantity", "value"), _summary(prof), file, _WIDTH)
    depths = _aggregate(prof.model, prof)
    last = len(depths) if module_depth < 0 else min(module_depth + 1, len(depths))
    rows = []
    for d in range(last):
        kinds = depths[d]
        n = min(top_modules, len(kinds))

        def top(i: int, fmt: Any, kinds: dict[str, list[float]] = kinds, n: int = n) -> str:
            ranked = sorted(kinds.items(), key=lambda kv: kv[1][i], reverse=True)[:n]
            return ", ".join(f"{k}: {fmt(v[i])}" for k, v in ranked)

        rows.append((d, top(0, params_to_string), top(1, macs_to_string), top(2, duration_to_string)))
    print_table(
        f"Top {top_modules} module types per depth (params, MACs, fwd latency)",
        ("depth", "params", "MACs", "fwd latency"),
        rows,
        file,
        _WIDTH,
    )
    if detailed:
        print_table("Per-module profile (forward)", _DETAIL_COLUMNS, _detail_rows(prof), file, _WIDTH)


def _summary(prof: Profile) -> list[tuple[str, str]]:
    flops, params = int(prof.get_total_flops()), int(prof.get_total_params())
    fwd = float(prof.get_total_duration())
    rows: list[tuple[str, str]] = []
    engine = prof.ds_engine
    if engine is not None:
        rows += [
            ("world size", str(engine.world_size)),
            ("data parallel size", str(engine.dp_world_size)),
            ("batch size per GPU", str(engine.train_micro_batch_size_per_gpu())),
        ]
    rows += [
        ("params of model (full size under ZeRO-3)", params_to_string(params)),
        ("fwd MACs per GPU", macs_to_string(flops // 2)),
        ("fwd flops per GPU", number_to_string(flops)),
        ("fwd latency", duration_to_string(fwd)),
        ("fwd FLOPS per GPU = fwd flops / fwd latency", flops_to_string(flops / fwd if fwd else 0.0)),
    ]
    timers = getattr(engine, "timers", None)
    if timers is not None and getattr(timers, "enabled", False):  # wall_clock_breakdown: the engine's timers
        ms = timers.mean_ms(reset=False)
        bwd, step = ms.get("backward", 0.0) / 1000.0, ms.get("step", 0.0) / 1000.0
        factor = 2.0 + prof.recompute_fwd_factor
        iteration = fwd + bwd + step
        rows += [
            ("bwd latency", duration_to_string(bwd)),
            (
                f"bwd FLOPS per GPU = {factor:g} x fwd flops / bwd latency",
                flops_to_string(factor * flops / bwd if bwd else 0),
            ),
            (
                f"fwd+bwd FLOPS per GPU = {factor + 1:g} x fwd flops / (fwd+bwd latency)",
                flops_to_string((factor + 1) * flops / (fwd + bwd) if fwd + bwd else 0),
            ),
            ("step latency", duration_to_string(step)),
            ("iter latency", duration_to_string(iteration)),
            (
                f"FLOPS per GPU = {factor + 1:g} x fwd flops / iter latency",
                flops_to_string((factor + 1) * flops / iteration if iteration else 0),
            ),
        ]
        if engine is not None and iteration:
            samples = engine.train_micro_batch_size_per_gpu() * engine.world_size
            rows.append(("samples/second", f"{samples / iteration:.2f}"))
    return rows


def _aggregate(model: nn.Module, prof: Profile) -> list[dict[str, list[float]]]:
    """Per depth, per module type: [params, MACs, fwd latency] summed over the modules of that type."""
    depths: list[dict[str, list[float]]] = []

    def walk(module: nn.Module, depth: int) -> None:
        if depth == len(depths):
            depths.append({})
        entry = depths[depth].setdefault(type(module).__name__, [0.0, 0.0, 0.0])
        entry[0] += prof.module_params(module)
        entry[1] += prof.module_flops(module) // 2
        entry[2] += prof.module_duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(model, 0)
    return depths


_DETAIL_COLUMNS = ("module", "params", "% params", "MACs", "% MACs", "fwd latency", "% latency", "fwd FLOPS")


def _detail_rows(prof: Profile) -> list[tuple[str, ...]]:
    total_params = int(prof.get_total_params()) or 1
    total_flops = int(prof.get_total_flops()) or 1
    total_time = float(prof.get_total_duration()) or 1.0
    rows: list[tuple[str, ...]] = []
    for name, module in prof.model.named_modules():
        depth = name.count(".") + 1 if name else 0
        label = "  " * depth + (name.rpartition(".")[2] or "(model)") + f" ({type(module).__name__})"
        params, flops, seconds = prof.module_params(module), prof.module_flops(module), prof.module_duration(module)
        rows.append(
            (
                label,
                params_to_string(params),
                f"{100 * params / total_params:.2f}%",
                macs_to_string(flops // 2),
                f"{100 * flops / total_flops:.2f}%",
                duration_to_string(seconds),
                f"{100 * seconds / total_time:.2f}%",
                flops_to_string(flops / seconds if seconds else 0.0),
            )
        )
    return rows
