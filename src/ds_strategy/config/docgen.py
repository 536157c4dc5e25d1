"""Generate docs/config.md from the schema: ``python -m ds_strategy.config.docgen > docs/config.md``.

A test regenerates the text and fails when the committed file is stale, so the reference can never
drift from what ``load_config`` accepts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .batch import EQUATION
from .checks import IMPLEMENTED_OPTIMIZERS
from .normalize import LEGACY_FORMS
from .schema import describe, load_schema, resolve, walk_properties
from .support import label, support_of

REGENERATE = "python -m ds_strategy.config.docgen > docs/config.md"

# The reference's worked example; the docs test writes it to ds_config.json, validates it and runs
# EXAMPLE_SCRIPT against it, so both stay true as the schema changes.
EXAMPLE_CONFIG: dict[str, Any] = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "reduce_bucket_size": 50000000,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
    },
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_num_steps": 100, "total_num_steps": 1000, "warmup_max_lr": 3e-4},
    },
    "comms_logger": {"enabled": False},
}

EXAMPLE_SCRIPT = """\
from ds_strategy.config import load_config

config = load_config("ds_config.json", world_size=8)  # validates; raises ConfigError listing every problem
b = config.batch
print(b.train_batch_size, b.train_micro_batch_size_per_gpu, b.gradient_accumulation_steps, b.world_size)
assert (b.train_batch_size, b.gradient_accumulation_steps) == (64, 2)  # 64 = 4 x 2 x 8: accumulation derived
print(config.zero_optimization.stage, config.zero_optimization.offload_optimizer.device, config.optimizer.type)
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(node: dict[str, Any]) -> str:
    if "default" not in node:
        return ""
    value = node["default"]
    text = f"`{json.dumps(value)}`"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10**6:
        mantissa, exponent = f"{value:e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        if float(mantissa) * 10 ** int(exponent) == value:
            text += f" ({mantissa}e{int(exponent)})"
    return text


def _support(path: str) -> str:
    entry = support_of(path)
    if entry is None:  # tests/config/test_support.py fails first
        raise KeyError(f"{path} is not classified in config/support.py")
    return label(entry)


def _table(rows: list[tuple[str, dict[str, Any]]], prefix: str = "") -> list[str]:
    lines = ["| key | accepts | default | description | ds_strategy |", "| --- | --- | --- | --- | --- |"]
    for key, node in rows:
        description = node.get("description", "")
        if "x-auto" in node:
            description += f' "auto": {node["x-auto"]}'
        accepts = "an object" if "properties" in node else describe(node)
        support = _support(f"{prefix}{key}")
        cells = [f"`{key}`", _cell(accepts), _cell(_default(node)), _cell(description.strip()), _cell(support)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _section(title: str, node: dict[str, Any], intro: str | None = None) -> list[str]:
    lines = [f"## `{title}`", ""]
    text = intro or node.get("description")
    if text:
        lines += [text, ""]
    rows = [(key, resolve(prop)) for key, prop in node.get("properties", {}).items()]
    lines += _table(rows, prefix=f"{title}.")
    lines.append("")
    return lines


def _params_sections(owner: str, node: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for clause in node.get("allOf", []):
        condition = clause["if"]["properties"]["type"]
        names = condition.get("enum", [condition.get("const")])
        params = resolve(clause["then"]["properties"]["params"])
        required = params.get("required", [])
        lines += [f"### `{owner}.params` for {', '.join(f'`{n}`' for n in names)}", ""]
        if required:
            lines += ["Required: " + ", ".join(f"`{r}`" for r in required) + ".", ""]
        lines += _table(
            [(key, resolve(prop)) for key, prop in params.get("properties", {}).items()], prefix=f"{owner}.params."
        )
        lines.append("")
    return lines


def render_markdown() -> str:
    schema = load_schema()
    top = resolve(schema)
    lines = [
        "# DeepSpeed config reference",
        "",
        "<!-- Generated from src/ds_strategy/config/ds_config.schema.json; do not edit. Regenerate with:",
        f"     {REGENERATE} -->",
        "",
        "`ds_strategy.config.load_config(config, *, world_size=None, context=None)` accepts a dict, a path to a JSON "
        "file (or JSON text) or a `DeepSpeedConfig`, validates it once against the JSON Schema shipped in the "
        "package, and returns frozen dataclasses whose field names are the keys below. Every problem of a config "
        "is reported together, each naming its JSON path, the value and what would be valid; unknown keys get a "
        "did-you-mean suggestion.",
        "",
        "Every key is in one of three classes, shown in the last column of its row: **acted on** (it changes "
        "what ds_strategy does), **warned** (accepted and ignored with one `IgnoredConfigWarning` on rank 0 naming "
        "the key and why; only where ignoring it changes neither results nor memory) or **refused** (a "
        "`ConfigError` naming the key, where ignoring it would change results or memory). A warned or refused "
        'key only warns or fails when its value asks for something (not its default, not `"enabled": false`). '
        "The classification lives in `src/ds_strategy/config/support.py`.",
        "",
        "Defaults follow DeepSpeed's code (0.19.8) where its documentation differs (`overlap_comm`, "
        "`steps_per_print`, `stage3_prefetch_bucket_size`). `gradient_clipping` is 1.0 in both; under Lightning "
        "and Fabric an absent value means the Trainer's `gradient_clip_val`, else no clipping.",
        "",
        "## A complete example",
        "",
        "A `ds_config.json` for ZeRO stage 2 in bf16 with the optimizer offloaded to CPU:",
        "",
        "<!-- snippet: file=ds_config.json -->",
        "```json",
        json.dumps(EXAMPLE_CONFIG, indent=2),
        "```",
        "",
        "Loading it validates every key and resolves the batch sizes for a world size (the strategy and "
        "`initialize()` do this for you):",
        "",
        "```python",
        EXAMPLE_SCRIPT.rstrip("\n"),
        "```",
        "",
        "## Batch size arithmetic",
        "",
        f"`{EQUATION}`, with `world_size` the data-parallel world size. Any two of the three batch values "
        "determine the third. Only `train_batch_size`: `gradient_accumulation_steps` is 1. Only the micro batch: "
        "`gradient_accumulation_steps` is 1. A contradiction, or a derived value that is not a positive integer, "
        "is an error that prints the equation with the numbers. Without a world size the triple stays unresolved "
        "(`DeepSpeedConfig.batch` raises) until `load_config(cfg, world_size=...)` re-resolves it.",
        "",
        '## "auto" values and the context',
        "",
        '`"auto"` is resolved from a `ConfigContext` (filled by the Lightning strategy from the Trainer, or by '
        "`initialize()` from its arguments): `micro_batch_size`, `gradient_accumulation_steps`, `gradient_clipping`, "
        "`precision`, `world_size`, `hidden_size`, `optimizer_params`, `scheduler_params`. An absent value counts "
        'as `"auto"`. When the config gives a value explicitly and the context disagrees, `context.on_conflict` '
        'decides: `"error"` (default) raises, `"prefer_config"` / `"prefer_context"` keep one and emit a '
        '`ConfigConflictWarning` naming the winner. Other `"auto"` values fall back to the default, except in '
        '`optimizer.params` and `scheduler.params`, which stay `"auto"` (see `OptimizerConfig.unresolved`).',
        "",
        "| key | resolved from |",
        "| --- | --- |",
    ]
    for path, _key, node in walk_properties(schema):
        if "x-auto" in node:
            lines.append(f"| `{path}` | {_cell(node['x-auto'])} |")
    lines += ["", "## Top level", ""]
    scalars = [(k, resolve(p)) for k, p in top["properties"].items()]
    lines += _table(
        [(k, n) for k, n in scalars if "properties" not in n and not (n.get("x-ignored") and n.get("type") == "object")]
    )
    lines.append("")

    for key, prop in top["properties"].items():
        node = resolve(prop)
        if "properties" not in node:
            continue
        lines += _section(key, node)
        for sub_key, sub_prop in node["properties"].items():
            sub = resolve(sub_prop)
            if "properties" in sub and not sub.get("x-ignored"):
                lines += _section(f"{key}.{sub_key}", sub)
        if key == "optimizer":
            implemented = ", ".join(f"`{n}`" for n in IMPLEMENTED_OPTIMIZERS)
            lines += [f"ds_strategy builds {implemented}; other DeepSpeed optimizer names load with a warning.", ""]
            lines += _params_sections(key, node)
        if key == "scheduler":
            lines += _params_sections(key, node)

    ignored_sections = [
        (k, resolve(p))
        for k, p in top["properties"].items()
        if resolve(p).get("x-ignored") and resolve(p).get("type") == "object"
    ]
    lines += [
        "## Accepted, ignored sections",
        "",
        "Well-known DeepSpeed sections ds_strategy does not implement; their content is not validated. An enabled "
        "one is either refused (a `ConfigError`, where ignoring it would change results or memory) or loads with "
        "one `IgnoredConfigWarning` (a monitor, a profiler: nothing else changes), as the last column says.",
        "",
        "| key | what it configures in DeepSpeed | ds_strategy |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{k}` | {_cell(n.get('description', ''))} | {_cell(_support(k))} |" for k, n in ignored_sections]
    lines += [
        "",
        "## Tolerated legacy forms",
        "",
        "Rewritten before validation; structural rewrites emit a `ConfigDeprecationWarning` (a `FutureWarning`). "
        "Giving both the legacy and the current spelling with different values is an error.",
        "",
        "| legacy form | current form |",
        "| --- | --- |",
    ]
    lines += [f"| {_cell(form.old)} | {_cell(form.new)} |" for form in LEGACY_FORMS]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render the DeepSpeed config reference (markdown) from the schema.")
    parser.add_argument("--output", "-o", type=Path, help="write here instead of stdout")
    args = parser.parse_args(argv)
    text = render_markdown()
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
