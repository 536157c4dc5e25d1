"""What the docs call refused, missing or absent is checked against the code (issue 42, criterion 4).

Where it can be automated, from the config support table's data (config/support.py) rather than a list
kept here:

- A feature the table says is built must not be called refused / not supported / not built anywhere a
  user reads: the docs pages (docs/config.md is generated from the table itself), README.md, and the
  package's docstrings. The features are the pages that the table's acted-on keys cite (``docs/nvme.md``
  for ``offload_*.device``, ``docs/zeropp.md`` for the ZeRO++ keys ...), named by their titles; MoE, which
  is a layer and has no key, is added by hand. A statement that names such a feature next to a refusal
  word is a contradiction unless ``CHECKED`` lists it with the reason it is true (a refused combination,
  another subject); a ``CHECKED`` entry that matches nothing fails too.
- A key a page says "is refused" / "is not supported" / "is not built" must be refused in the table.
- Every ``docs/<page>.md`` the package, the README or the docs name exists.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from ds_strategy.config.support import ACTED, REFUSED, SUPPORT

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
NEGATIVE = re.compile(
    r"\b(refused|refuses|refuse|not supported|unsupported|not built|not available|does not exist|not implemented|"
    r"not yet|absent|missing)\b",
    re.I,
)
# Features without a config key of their own: (page, names).
KEYLESS = {"moe": ("MoE", "mixture of experts", "expert parallelism")}
# Statements naming a built feature next to a refusal word, read and found true: (where, text, why).
CHECKED = [
    ("docs/moe.md", "NVMe offload with MoE layers are refused",
     "the combination is refused (runtime/moe/engine_moe.py); NVMe offload alone is built"),
    ("docs/troubleshooting.md", "with MoE layers is not supported",
     "quotes engine_moe.py's error for the refused combination"),
    ("docs/troubleshooting.md", "zero_optimization.stage 3 with MoE layers is not supported",
     "quotes engine_moe.py's error: MoE at stage 3 is refused (stages 0-2 are built)"),
    ("docs/moe.md", "ZeRO stage 3 and NVMe offload with MoE layers",
     "stage 3 and NVMe offload are refused with MoE layers only"),
    ("README.md", "not yet words", "the demo model's samples: the refusal word is about the text it writes"),
    ("src/ds_strategy/ops/aio.py", "tmpfs refuses", "the file system refuses O_DIRECT, not ZeRO-Infinity"),
    ("src/ds_strategy/runtime/checkpoint/torch_optim.py", "MoE expert groups keep their state by other keys",
     "importing a plain torch optimizer state into expert groups is the refused case; MoE itself is built"),
    ("src/ds_strategy/runtime/zero/leaf.py", "transformers' MoE blocks, absent from most models",
     "about the models a class list matches, not about ds_strategy's MoE"),
    ("docs/finetuning.md", "a ratio is refused with NVMe offload and with `offload_param`",
     "the combination is refused (config/checks.py); NVMe offload alone is built"),
    ("docs/sequence_parallel.md", "Not built: sequence parallelism beside `ds_strategy.moe.MoE` layers or inside",
     "the combinations are refused (runtime/engine.py, runtime/initialize.py); Ulysses alone is built"),
    ("docs/troubleshooting.md", "expert parallelism beside Ulysses sequence parallelism is not built",
     "quotes the engine's error for the refused combination MoE + Ulysses"),
    ("docs/troubleshooting.md", "Ulysses sequence parallelism inside pipeline stages is not built",
     "quotes initialize's error for the refused combination pipeline + Ulysses"),
    ("docs/troubleshooting.md", "is not supported (the core is causal over the whole sequence)",
     "quotes the attention's error: sliding windows shorter than the sequence are refused, Ulysses is built"),
    ("docs/troubleshooting.md", "(a key/value cache: generation) is not supported",
     "quotes the attention's error: generation with a cache is refused, Ulysses training is built"),
    ("src/ds_strategy/sequence/hf.py", "Refuse a mask Ulysses cannot honour",
     "a docstring about refusing masks with padding in the middle, not about Ulysses"),
]  # fmt: skip


def feature_names() -> dict[str, str]:
    """Name -> page of every built feature (see the module docstring)."""
    pages = {
        page for entry in SUPPORT.values() if entry.kind == ACTED for page in re.findall(r"docs/(\w+)\.md", entry.note)
    }
    pages.discard("config")
    names: dict[str, str] = {}
    for page in sorted(pages):
        title = (DOCS / f"{page}.md").read_text().splitlines()[0].lstrip("# ")
        parts = re.split(r",\s*|\s+and\s+", re.split(r"[:(]", title)[0]) + re.findall(r"\(([^)`]+)\)", title)
        for part in parts:
            part = re.sub(r"^(the|a)\s+", "", part.strip(), flags=re.I)
            if len(part) >= 3:
                names[part] = page
    for page, extra in KEYLESS.items():
        names.update(dict.fromkeys(extra, page))
    return names


def texts() -> Iterator[tuple[str, str]]:
    """(where, text) of every page, the README and every docstring of the package."""
    for path in sorted(DOCS.glob("*.md")):
        if path.name != "config.md":
            yield f"docs/{path.name}", path.read_text()
    yield "README.md", (REPO / "README.md").read_text()
    for path in sorted((REPO / "src" / "ds_strategy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    yield path.relative_to(REPO).as_posix(), doc


def statements(text: str) -> Iterator[str]:
    """Sentences and clauses (a table row's cells apart), code blocks left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        rows = [cell for line in lines if line.lstrip().startswith("|") for cell in line.split("|")]
        prose = " ".join(" ".join(line.split()) for line in lines if not line.lstrip().startswith("|"))
        for piece in [*rows, prose]:
            yield from (c for c in re.split(r"(?<=[.!?])\s+|;\s*", piece) if c.strip())


def contradictions() -> list[tuple[str, str, str]]:
    names = feature_names()
    found = []
    for where, text in texts():
        for clause in statements(text):
            if not NEGATIVE.search(clause):
                continue
            for name in names:
                if re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w])", clause, re.I):
                    found.append((where, name, clause))
    return found


def test_the_features_come_from_the_support_table() -> None:
    names = feature_names()
    # What the table's acted-on keys point at today, as a check of the derivation.
    assert names.get("NVMe offload") == "nvme" and names.get("ZeRO-Infinity") == "nvme"
    assert names.get("ZeRO++") == "zeropp" and names.get("hpZ") == "zeropp"
    assert names.get("Pipeline parallelism") == "pipeline" and names.get("hybrid engine") == "hybrid_engine"


def test_the_scan_catches_a_built_feature_called_refused() -> None:
    # The drift issue 42 found (docs/zero3.md and config/support.py's header before the fix).
    drift = "- NVMe offload (refused), activation checkpointing that re-runs forwards inside backward (untested)."
    names = feature_names()
    hits = [n for c in statements(drift) if NEGATIVE.search(c) for n in names if n.lower() in c.lower()]
    assert hits == ["NVMe offload"], hits


def test_no_page_or_docstring_calls_a_built_feature_refused() -> None:
    found = contradictions()
    unexplained = [
        (where, name, clause)
        for where, name, clause in found
        if not any(where == w and text in clause for w, text, _ in CHECKED)
    ]
    assert not unexplained, "statements calling a built feature refused or missing:\n" + "\n".join(
        f"  {where}: [{name}] {clause}" for where, name, clause in unexplained
    )
    stale = [(w, text) for w, text, _ in CHECKED if not any(where == w and text in c for where, _, c in found)]
    assert not stale, f"CHECKED entries that no longer match a statement (remove them): {stale}"


KEY_REFUSED = re.compile(
    r"`([a-z0-9_.]+)`(?:\s*\([^)]*\))?\s+(?:is|are|stays|stay|remains|remain)\s+(?:still\s+)?"
    r"(?:refused|not supported|not built)"
)
# Keys of other things than the config, called refused in the docs: (page, key, why).
NOT_CONFIG = [
    ("docs/optimizers.md", "maximize", "CPUAdam's own argument (ops/optimizers.py refuses maximize=True)"),
    ("docs/lightning.md", "storage_options", "Trainer.save_checkpoint's argument, not a config key"),
]


def test_a_key_the_docs_call_refused_is_refused_in_the_table() -> None:
    leaves: dict[str, list[str]] = {}
    for key in SUPPORT:
        leaves.setdefault(key.rsplit(".", 1)[-1], []).append(key)
    wrong = []
    seen = set()
    for where, text in texts():
        if not where.startswith("docs/"):
            continue
        for match in KEY_REFUSED.finditer(" ".join(text.split())):
            name = match.group(1)
            if any(where == w and name == k for w, k, _ in NOT_CONFIG):
                seen.add((where, name))
                continue
            keys = [name] if name in SUPPORT else leaves.get(name, [])
            if not keys or any(SUPPORT[k].kind != REFUSED for k in keys):
                wrong.append((where, match.group(0), {k: SUPPORT[k].kind for k in keys}))
    assert not wrong, f"keys the docs call refused that the support table does not refuse: {wrong}"
    assert seen == {(w, k) for w, k, _ in NOT_CONFIG}, seen


def test_every_docs_page_named_exists() -> None:
    named = set()
    sources = [*DOCS.glob("*.md"), REPO / "README.md", *(REPO / "src" / "ds_strategy").rglob("*.py")]
    for path in sources:
        text = path.read_text()
        named |= {(path.name, m) for m in re.findall(r"(?<![\w/.])docs/([\w-]+\.md)", text)}
        if path.suffix == ".md":
            named |= {(path.name, m) for m in re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", text)}
    missing = sorted((src, page) for src, page in named if not (DOCS / page).is_file())
    assert not missing, f"pages named but absent from docs/: {missing}"
