"""Every error and warning message ds_strategy can show a user is explained in docs/troubleshooting.md.

The messages are read from the source, not from a list kept by hand: every ``raise X("...")`` and
``TORCH_CHECK(cond, "...")``, every config problem (``ConfigProblem(path, "...")``, which ``ConfigError``
reports) and every ``warnings.warn`` / logger warning with a literal text. A message's *stable phrase* is
its longest literal fragment (the text between two interpolated values); troubleshooting.md must contain
it, so writing the message with ``<placeholders>`` where the code interpolates values is enough, and a
reworded message fails this test until its entry is updated. New errors must be documented.

``python -m tests.docs.test_troubleshooting_coverage`` prints the catalogue (file, line, message with
placeholders, phrase, documented or not): the starting point for documenting a new error.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "ds_strategy"
CSRC = REPO / "csrc"
DOC = REPO / "docs" / "troubleshooting.md"

# A phrase shorter than this says nothing on its own ("got ", ": "); such messages need an allowlist entry.
MIN_PHRASE = 8

# Internal invariants a user cannot trigger through the public API: (file relative to src/ds_strategy or
# csrc, phrase) -> why it is not documented. Keep it short; a user-facing message belongs in the doc.
ALLOWLIST: dict[tuple[str, str], str] = {
    ("config/schema.py", "schema uses an unsupported $ref:"): "the shipped schema only uses local $refs (tested)",
    ("accelerator/cpu.py", "in /proc/self/status"): "parses the kernel's /proc/self/status, always in kB",
    ("comm/logger.py", "unreachable"): "exhaustive match on the op kinds the logger itself defines",
    ("comm/logger.py", "bus_factor: world_size must be >= 1, got"): "world sizes come from torch.distributed",
    ("__init__.py", "module 'ds_strategy' has no attribute"): "Python's own AttributeError wording, for a typo",
    ("config/docgen.py", "is not classified in config/support.py"): "developers adding a schema key (tested first)",
    ("runtime/swap/files.py", ": nothing was written for"): "the swappers read only regions they wrote (tested)",
}

# Documented, but their literal part is too short to identify them: (file, phrase) -> where the doc covers it.
SHORT_PHRASES: dict[tuple[str, str], str] = {
    ("config/schema.py", "(got"): "jsonschema's own message + the value: 'Keys, types and values'",
}

_RAISE_CALLS = {"ConfigProblem": 1}  # constructor -> index of the message argument
# lists that collect messages: name -> kind (``problems.append(...)``, ``res.conflicts.append(...)``)
_COLLECTED = {"problems": "problem", "notes": "warning", "conflicts": "warning", "deprecations": "warning"}
_WARN_FUNCS = {"warn", "warning", "warn_once", "rank_zero_warn"}


@dataclass(frozen=True)
class Message:
    file: str  # relative to src/ds_strategy (Python) or csrc (C++)
    line: int
    kind: str  # raise | problem | warning | check
    text: str  # with <placeholders> for interpolated values
    phrase: str  # longest literal fragment, stripped


def _render(node: ast.expr, names: dict[str, ast.expr], depth: int = 0) -> list[str | None] | None:
    """Literal fragments of a string expression; None entries stand for interpolated values.

    Returns None when the expression holds no literal text at all (a relay such as ``raise exc``).
    """
    if depth > 4:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out: list[str | None] = []
        for value in node.values:
            out.append(value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None)
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        left = _render(node.left, names, depth + 1)
        if isinstance(node.op, ast.Mod):
            return left
        right = _render(node.right, names, depth + 1)
        if left is None and right is None:
            return None
        return (left or [None]) + (right or [None])
    if isinstance(node, ast.Tuple) and node.elts:  # (WarningClass, "message")
        return _render(node.elts[-1], names, depth + 1)
    if isinstance(node, ast.Name) and node.id in names:
        return _render(names[node.id], names, depth + 1)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "join"
        and node.args
        and isinstance(node.args[0], (ast.List, ast.Tuple))
    ):
        # "sep".join([...]) of literal lines (multi-line messages)
        parts: list[str | None] = []
        for element in node.args[0].elts:
            parts += _render(element, names, depth + 1) or [None]
        return parts
    return None


def _text(parts: list[str | None]) -> str:
    return "".join("<...>" if p is None else p for p in parts)


_PERCENT = re.compile(r"%[-#0-9.]*[sdrfgx]")  # logger messages interpolate with %-formatting


def _phrase(parts: list[str | None]) -> str:
    fragments = [f.strip() for p in parts if p is not None for f in _PERCENT.split(p)]
    return max(fragments, key=len, default="")


def _assignments(func: ast.AST) -> dict[str, ast.expr]:
    """name -> the string expression last assigned to it in this function (messages built in a variable)."""
    names: dict[str, ast.expr] = {}
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and _render(node.value, {}) is not None
        ):
            names[node.targets[0].id] = node.value
    return names


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _receiver(call: ast.Call) -> str:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return ""
    owner = func.value
    return owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""


def _message_arg(call: ast.Call, index: int) -> ast.expr | None:
    if len(call.args) > index:
        return call.args[index]
    for keyword in call.keywords:
        if keyword.arg in ("message", "msg"):
            return keyword.value
    return None


def _names_in_scope(tree: ast.AST) -> dict[int, dict[str, ast.expr]]:
    """id(node) -> the message variables of the function that contains it."""
    names_at: dict[int, dict[str, ast.expr]] = {}
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = _assignments(scope)
            for node in ast.walk(scope):
                names_at.setdefault(id(node), names)
    return names_at


def _message_calls(tree: ast.AST) -> Iterator[tuple[ast.Call, int, str, ast.stmt | ast.expr]]:
    """(call, index of its message argument, kind, node) of every message-bearing call."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            yield node.exc, 0, "raise", node
        elif isinstance(node, ast.Call):
            name = _call_name(node)
            if name in _RAISE_CALLS:
                yield node, _RAISE_CALLS[name], "problem", node
            elif name == "append" and _receiver(node) in _COLLECTED:
                # messages collected, then raised together (problems) or emitted as config warnings
                yield node, 0, _COLLECTED[_receiver(node)], node
            elif name in _WARN_FUNCS:
                yield node, 0, "warning", node


def python_messages() -> list[Message]:
    out: list[Message] = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names_at = _names_in_scope(tree)
        for call, index, kind, node in _message_calls(tree):
            arg = _message_arg(call, index)
            parts = None if arg is None else _render(arg, names_at.get(id(node), {}))
            if parts is not None:
                out.append(Message(rel, node.lineno, kind, _text(parts), _phrase(parts)))
    return out


_CHECK = re.compile(r"TORCH_CHECK\((.*?)\);", re.S)
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _split_arguments(body: str) -> list[str]:
    """Top-level comma-separated arguments of a macro call (commas inside (), [], <> or strings don't count)."""
    args, depth, current, in_string = [], 0, "", False
    for i, char in enumerate(body):
        if char == '"' and (i == 0 or body[i - 1] != "\\"):
            in_string = not in_string
        elif not in_string and char in "([":
            depth += 1
        elif not in_string and char in ")]":
            depth -= 1
        elif not in_string and char == "," and depth == 0:
            args.append(current)
            current = ""
            continue
        current += char
    args.append(current)
    return args


_STREAM = re.compile(r'\bmsg\s*<<((?:[^;"]|"(?:[^"\\]|\\.)*")*);')  # up to the first ';' outside a string


def _unescape(literal: str) -> str:
    return literal.replace("\\n", "\n").replace('\\"', '"').replace("\\\\", "\\")


def _stream_parts(body: str) -> list[str | None]:
    """``msg << "a" << x << "b"``: the operands between top-level ``<<`` (literals as text)."""
    parts: list[str | None] = []
    for operand in re.split(r"<<(?=(?:[^\"]*\"[^\"]*\")*[^\"]*$)", body):
        literal = _STRING.fullmatch(operand.strip())
        parts.append(_unescape(literal.group(1)) if literal else None)
    return parts


def cpp_messages() -> list[Message]:
    """TORCH_CHECK messages: the arguments after the condition; a string literal is text, anything else an
    interpolated value. Messages assembled in an ``std::ostringstream msg`` (then ``TORCH_CHECK(false,
    msg.str())``) count statement by statement, for statements with a phrase of MIN_PHRASE characters
    (shorter ones, such as ``msg << " (pid " << pid``, continue a sentence documented with its start)."""
    out: list[Message] = []
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".cpp", ".h", ".cu", ".cuh"):
            continue
        text = path.read_text(encoding="utf-8")
        for match in _CHECK.finditer(text):
            parts: list[str | None] = []
            for arg in _split_arguments(match.group(1))[1:]:
                literal = _STRING.fullmatch(arg.strip())
                parts.append(_unescape(literal.group(1)) if literal else None)
            if not any(parts):
                continue
            line = text.count("\n", 0, match.start()) + 1
            out.append(Message(path.relative_to(CSRC).as_posix(), line, "check", _text(parts), _phrase(parts)))
        for match in _STREAM.finditer(text):
            parts = _stream_parts(match.group(1))
            if len(_phrase(parts)) >= MIN_PHRASE:
                line = text.count("\n", 0, match.start()) + 1
                out.append(Message(path.relative_to(CSRC).as_posix(), line, "check", _text(parts), _phrase(parts)))
    return out


def all_messages() -> list[Message]:
    return python_messages() + cpp_messages()


def doc_text() -> str:
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    # Table cells escape pipes; messages are compared with whitespace runs folded (the doc wraps lines).
    return " ".join(text.replace("\\|", "|").split())


def documented(message: Message, text: str) -> bool:
    return " ".join(message.phrase.split()) in text


def allowlisted(message: Message) -> bool:
    return (message.file, message.phrase) in ALLOWLIST


def test_every_message_is_documented() -> None:
    text = doc_text()
    missing = [m for m in all_messages() if not allowlisted(m) and not documented(m, text)]
    assert not missing, "messages missing from docs/troubleshooting.md (document them, see its top):\n" + "\n".join(
        f"  {m.file}:{m.line} [{m.kind}] {m.text!r} (phrase {m.phrase!r})" for m in missing
    )


def test_every_message_has_a_stable_phrase() -> None:
    short = [
        m
        for m in all_messages()
        if len(m.phrase) < MIN_PHRASE and not allowlisted(m) and (m.file, m.phrase) not in SHORT_PHRASES
    ]
    listing = "\n".join(f"  {m.file}:{m.line} {m.text!r}" for m in short)
    assert not short, f"messages without a literal phrase of >= {MIN_PHRASE} characters (reword, or list):\n{listing}"


def test_allowlist_is_current() -> None:
    found = {(m.file, m.phrase) for m in all_messages()}
    stale = [key for key in [*ALLOWLIST, *SHORT_PHRASES] if key not in found]
    assert not stale, f"allowlist entries that match no message any more (remove them): {stale}"


def test_the_scanner_sees_every_kind_of_message() -> None:
    # A scanner that silently found nothing would pass the coverage test: check it finds known messages.
    kinds = {m.kind for m in all_messages()}
    assert kinds == {"raise", "problem", "warning", "check"}
    assert len(all_messages()) > 200


if __name__ == "__main__":
    text = doc_text()
    for m in all_messages():
        state = "allow" if allowlisted(m) else "ok" if documented(m, text) else "MISSING"
        print(f"{state:7} {m.file}:{m.line} [{m.kind}] {m.text!r} || {m.phrase!r}")
    sys.exit(0)
