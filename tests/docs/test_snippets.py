"""Every code block in docs/*.md runs (or is checked) in this test: one test per page.

The rules (also stated at the top of docs/index.md, "How the docs are tested"):

- The blocks of a page run in order in one fresh temporary directory, which starts with a copy of the
  repository's ``examples/``. A directive on the line right before a fence changes what happens to it:
  ``<!-- snippet: file=NAME -->`` writes the block to NAME (not run), ``<!-- snippet: ranks=N -->`` runs a
  python block on N CPU processes with the variables ``ds-launch`` gives its ranks (forked from the
  block host below; without ``os.fork``, under ``ds-launch`` itself), ``<!-- snippet: parse -->`` checks a shell block's
  commands without running them, ``<!-- snippet: skip REASON -->`` is for hardware this machine lacks.
- ``python``: run as a standalone script (``DS_ACCELERATOR=cpu``, the repository's src importable), in a
  child forked from a process that imported torch and lightning once (tests/docs/block_host.py).
- ``bash`` / ``sh`` / ``console``: every command runs with bash (``$ `` prompts stripped; in ``console``
  blocks lines without a prompt are output), the interpreter's bin directory first on PATH.
- ``json``: must parse; a DeepSpeed config (it has one of the ``DS_CONFIG_KEYS``) must pass ``load_config``.
- ``yaml``: must parse. ``text``: output or an illustration, not run. Any other language (or none) fails.

Failures name the page and line of the block and show its output.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from benchmarks.common import free_port

from tests.docs.block_host import BlockHost, HostTimeout

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK_TIMEOUT_S = 180
SHELL = ("bash", "sh", "console")
LANGUAGES = ("python", *SHELL, "json", "yaml", "text")
DS_CONFIG_KEYS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "optimizer")
# A skip is only for hardware this machine lacks; the reason must say which.
SKIP_REASON = re.compile(r"cuda|gpu|node|host|nvme", re.IGNORECASE)
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[^`\s]*)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")
# Our entry points: checked with --help appended (ds-launch: its own parser, since text after the script
# belongs to the script). External programs are only looked up on PATH.
OUR_MODULES = re.compile(r"^ds_strategy(\.|$)|^benchmarks(\.|$)")
SHELL_BUILTINS = {"cd", "export", "set", "unset", "source", ".", "echo", "true", "test", "[", "mkdir", "ls", "cat"}


class DocsError(AssertionError):
    pass


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    file: str | None = None
    ranks: int | None = None
    parse: bool = False
    skip: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page}:{self.line}"


def _directive(line: str, where: str) -> dict[str, str]:
    m = DIRECTIVE.match(line)
    if m is None:
        return {}
    body = m.group("body")
    out: dict[str, str] = {}
    tokens = body.split()
    while tokens:
        token = tokens.pop(0)
        if token == "skip":
            out["skip"] = " ".join(tokens)
            break
        if token == "parse":
            out["parse"] = "1"
        elif "=" in token and token.split("=", 1)[0] in ("file", "ranks"):
            key, value = token.split("=", 1)
            out[key] = value
        else:
            raise DocsError(f"{where}: unknown snippet directive {token!r} in {line.strip()!r}")
    return out


def extract_blocks(page: Path, text: str | None = None) -> list[Block]:
    """Fenced blocks of a markdown page with the directive on the line before each fence."""
    lines = (page.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, indent, lang = i, len(m.group("indent")), m.group("lang").lower()
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        if i == len(lines):
            raise DocsError(f"{page.name}:{start + 1}: the code fence is never closed")
        i += 1
        where = f"{page.name}:{start + 1}"
        d = _directive(lines[start - 1], where) if start > 0 else {}
        blocks.append(
            Block(
                page=page,
                line=start + 1,
                lang=lang,
                text="\n".join(body) + "\n",
                file=d.get("file"),
                ranks=int(d["ranks"]) if "ranks" in d else None,
                parse="parse" in d,
                skip=d.get("skip"),
            )
        )
    return blocks


def shell_commands(block: Block) -> list[tuple[int, str]]:
    """(doc line, command) pairs: prompts stripped, backslash continuations joined, comments dropped."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    pending_line = 0
    for offset, raw in enumerate(block.text.splitlines(), start=1):
        line = raw.rstrip()
        if not pending:
            stripped = line.lstrip()
            if stripped.startswith("$ ") or stripped == "$":
                line = stripped[2:]
            elif block.lang == "console":
                continue  # output
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            pending_line = block.line + offset
        if line.endswith("\\"):
            pending.append(line[:-1].rstrip())
            continue
        pending.append(line.strip() if pending else line)
        out.append((pending_line, " ".join(p for p in pending if p)))
        pending = []
    if pending:
        raise DocsError(f"{block.where}: the last command ends with a backslash")
    return out


# --------------------------------------------------------------------------------------------- running


def _env() -> dict[str, str]:
    import ds_strategy

    src = Path(ds_strategy.__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["DS_ACCELERATOR"] = "cpu"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    env["MPLBACKEND"] = "Agg"
    # A page that runs a benchmark must never overwrite the committed results (benchmarks/common.py).
    env["DS_STRATEGY_BENCH_RESULTS"] = _BENCH_RESULTS
    # The port Lightning's own launcher (Trainer(devices=2) in a plain `python x.py`) gives its ranks: from
    # this worker's range (benchmarks/common.py free_port), not a bind(0) pick another test could take too.
    env["STANDALONE_PORT"] = str(free_port())
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)  # a page runs as a user's fresh shell would
    return env


_HOST = BlockHost()
atexit.register(_HOST.close)
_BENCH_RESULTS = tempfile.mkdtemp(prefix="ds-docs-bench-")
atexit.register(shutil.rmtree, _BENCH_RESULTS, ignore_errors=True)


def _run(argv: list[str], cwd: Path, block: Block, what: str, ranks: int = 0, env: dict[str, str] | None = None) -> str:
    """Run one command of a block (on ``ranks`` ranks when given); its output (stdout and stderr) on success,
    DocsError otherwise. Python commands run in children of the block host (block_host.py: torch and
    lightning imported once)."""
    start = time.monotonic()
    use_host = BlockHost.usable and BlockHost.command(argv)
    code, out = _host_run(argv, cwd, ranks, env or {}) if use_host else _process_run(argv, cwd, env or {})
    if code is None:
        raise DocsError(f"{what}: still running after {BLOCK_TIMEOUT_S} s\n{out[-4000:]}")
    if code != 0:
        raise DocsError(f"{what}: exit code {code}\n{out[-6000:]}")
    print(f"----- {what}: ok in {time.monotonic() - start:.1f} s\n{out[-3000:]}")  # shown with pytest -s
    return out


def _host_run(argv: list[str], cwd: Path, ranks: int, env: dict[str, str]) -> tuple[int | None, str]:
    """(exit code, output); the code is None when the command ran past BLOCK_TIMEOUT_S."""
    try:
        port = free_port() if ranks else 0
        return _HOST.run(argv, cwd, _env() | env, BLOCK_TIMEOUT_S, ranks=ranks, port=port)
    except HostTimeout as exc:
        return None, exc.output


def _process_run(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int | None, str]:
    try:
        proc = subprocess.run(
            argv,
            cwd=cwd,
            env=_env() | env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        return None, exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
    return proc.returncode, proc.stdout


def run_python(block: Block, cwd: Path) -> None:
    script = cwd / f"_snippet_{block.page.stem}_{block.line}.py"
    script.write_text(block.text, encoding="utf-8")
    if block.ranks and BlockHost.usable:  # forked ranks with the launcher's variables (block_host.py)
        what = f"{block.where} (python block on {block.ranks} ranks)"
        _run([sys.executable, script.name], cwd, block, what, ranks=block.ranks)
    elif block.ranks:
        argv = [sys.executable, "-m", "ds_strategy.launcher", "--num_procs", str(block.ranks)]
        argv += ["--master_port", str(free_port()), "--no_local_rank", script.name]
        _run(argv, cwd, block, f"{block.where} (python block on {block.ranks} ranks)")
    else:
        _run([sys.executable, script.name], cwd, block, f"{block.where} (python block)")


def python_commands(block: Block) -> list[tuple[int, dict[str, str], list[str]]] | None:
    """(doc line, variables, argv) of every command when each is a plain ``[VAR=value ...] python ...`` (no
    pipe, redirection, list or substitution): such a block runs command by command in the block host, as
    bash would run it; None for any other block."""
    out = []
    for line, command in shell_commands(block):
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            words = list(lexer)
        except ValueError:
            return None
        if any(set(w) <= set("();<>|&") for w in words) or any(c in command for c in "$`*?~"):
            return None
        env = {}
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if not words or words[0] != "python":
            return None
        out.append((line, env, [sys.executable, *words[1:]]))
    return out or None


def run_shell(block: Block, cwd: Path) -> None:
    """One bash script for the block, so `cd` and `export` carry over; a failure names its doc line.

    bash/sh blocks run as written (heredocs, loops and continuations work; `$ ` prompts are stripped);
    console blocks run only their prompted commands. A block of plain ``python`` commands runs them one by
    one in the block host instead (``python`` on the block's PATH is this interpreter), stopping at the
    first failure as ``set -e`` does."""
    commands = python_commands(block) if BlockHost.usable else None
    if commands is not None:
        for line, env, argv in commands:
            _run(argv, cwd, block, f"{block.page.name}:{line} (shell command)", env=env)
        return
    # A launcher the page starts without --master_port would take the default 29500, which another test
    # running beside this one may hold: it gets a free port first (a --master_port the page sets wins).
    # On the first line with `set`, so the block's lines keep their numbers in the script.
    port = free_port()
    launchers = " ".join(
        f'{prog}() {{ command {prog} --master_port {port} "$@"; }};' for prog in ("ds-launch", "torchrun")
    )
    lines = [f"set -eo pipefail; {launchers}"]
    if block.lang == "console":
        lines.append("trap 'echo \"<docs> failed: $__DOC_CMD\" >&2' ERR")
        for line, command in shell_commands(block):
            lines.append(f"__DOC_CMD={shlex.quote(f'{block.page.name}:{line}: {command}')}")
            lines.append(command)
    else:
        offset = block.line - 2  # script line 3 is the block's first line, doc line block.line + 1
        lines.append(f"trap 'echo \"<docs> failed: {block.page.name}:$((LINENO + {offset}))\" >&2' ERR")
        lines += [re.sub(r"^(\s*)\$ ", r"\1", raw) for raw in block.text.splitlines()]
    script = cwd / f"_snippet_{block.page.stem}_{block.line}.sh"
    script.write_text("\n".join(lines) + "\n", encoding="utf-8")
    _run(["bash", script.name], cwd, block, f"{block.where} (shell block)")


def _split_pipeline(command: str) -> list[list[str]]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    parts: list[list[str]] = [[]]
    skip_next = False
    for token in lexer:
        if skip_next:
            skip_next = False
        elif token in ("&&", "||", ";", "|", "&"):
            parts.append([])
        elif token in (">", ">>", "<", "2>", "&>"):
            skip_next = True
        else:
            parts[-1].append(token)
    return [p for p in parts if p]


def check_command(words: list[str], cwd: Path, block: Block, where: str, notes: list[str]) -> None:
    """A `parse` command: the program exists and, for our entry points, its options parse."""
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]  # FOO=bar cmd
    if not words:
        return
    if words[0] in SHELL_BUILTINS:
        return
    prog, args = Path(words[0]).name, words[1:]
    if prog in ("python", "python3") and args[:1] == ["-m"] and len(args) >= 2:
        module, rest = args[1], args[2:]
        if module == "ds_strategy.launcher":
            _check_launch_flags(rest, cwd, block, where)
        elif OUR_MODULES.match(module):
            _run([sys.executable, "-m", module, *rest, "--help"], cwd, block, f"{where}: python -m {module} --help")
        elif module in ("pip", "venv", "pytest", "nox"):
            _run([sys.executable, "-m", module, "--help"], cwd, block, f"{where}: python -m {module} --help")
            if module == "pytest":
                _check_test_paths(rest, where)
        else:
            notes.append(f"{where}: python -m {module}: not one of ours, only the interpreter was checked")
        return
    if prog in ("python", "python3"):
        target = args[0] if args else ""
        if target and not target.startswith("-") and not (cwd / target).exists():
            raise DocsError(f"{where}: {target} does not exist (neither written by the page nor in examples/)")
        return
    if prog == "ds-launch":
        _check_launch_flags(args, cwd, block, where)
    elif prog == "ds-zero-to-fp32":
        _run([sys.executable, "-m", "ds_strategy.runtime.checkpoint.consolidate", "--help"], cwd, block, where)
        if len([a for a in args if not a.startswith("-")]) < 2:
            raise DocsError(f"{where}: ds-zero-to-fp32 takes CHECKPOINT_DIR OUTPUT")
    elif prog == "nox":
        _check_nox(args, where, notes)
    elif prog in ("pip", "pip3"):
        if not args or args[0] not in ("install", "uninstall", "show", "list", "download", "wheel", "freeze"):
            raise DocsError(f"{where}: unknown pip command {args[:1]}")
    elif shutil.which(prog, path=_env()["PATH"]) is None:
        notes.append(f"{where}: {prog} is not installed here; not checked")


PYTEST_VALUE_OPTIONS = {"-k", "-m", "-p", "-o", "-c", "-n", "--durations", "--timeout", "--maxfail", "--rootdir"}


def _check_test_paths(args: list[str], where: str) -> None:
    """`python -m pytest tests/x -q`: the paths it names exist in the repository (run from its root)."""
    skip = False
    for arg in args:
        if skip or arg.startswith("-"):
            skip = arg in PYTEST_VALUE_OPTIONS
            continue
        if not (ROOT / arg.split("::")[0]).exists():
            raise DocsError(f"{where}: pytest path {arg} does not exist in the repository")


def _check_launch_flags(args: list[str], cwd: Path, block: Block, where: str) -> None:
    code = "import sys; from ds_strategy.launcher import parse_args; parse_args(sys.argv[1:])"
    _run([sys.executable, "-c", code, *args], cwd, block, f"{where}: ds-launch flags")


def _check_nox(args: list[str], where: str, notes: list[str]) -> None:
    sessions = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-s", "--session", "--sessions")]
    nox = shutil.which("nox", path=_env()["PATH"])
    if nox is not None:
        listed = subprocess.run(
            [nox, "-l", "-f", str(ROOT / "noxfile.py")], capture_output=True, text=True, timeout=120, check=False
        ).stdout
        known = set(re.findall(r"^[*-] (\S+)", listed, flags=re.MULTILINE))
    else:
        notes.append(f"{where}: nox is not installed; session names read from noxfile.py")
        known = set(re.findall(r"@nox\.session[^\n]*\ndef (\w+)", (ROOT / "noxfile.py").read_text()))
    for name in sessions:
        if name not in known:
            raise DocsError(f"{where}: nox session {name!r} does not exist (sessions: {sorted(known)})")


def parse_shell(block: Block, cwd: Path, notes: list[str]) -> None:
    for line, command in shell_commands(block):
        where = f"{block.page.name}:{line}"
        for words in _split_pipeline(command):
            check_command(words, cwd, block, where, notes)


def check_json(block: Block) -> None:
    try:
        data = json.loads(block.text)
    except json.JSONDecodeError as exc:
        raise DocsError(f"{block.where} (json block): does not parse: {exc}") from None
    if isinstance(data, dict) and any(key in data for key in DS_CONFIG_KEYS):
        from ds_strategy.config import ConfigError, load_config

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_config(data)
        except ConfigError as exc:
            raise DocsError(f"{block.where} (json block, a ds_config): {exc}") from None


def run_page(page: Path, workdir: Path) -> list[str]:
    """Run every block of a page in order; return notes (skips, unchecked programs); raise on failures."""
    examples = ROOT / "examples"
    if examples.is_dir():
        ignore = shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints")
        shutil.copytree(examples, workdir / "examples", ignore=ignore, dirs_exist_ok=True)
    notes: list[str] = []
    failures: list[str] = []
    for block in extract_blocks(page):
        try:
            run_block(block, workdir, notes)
        except DocsError as exc:
            failures.append(str(exc))
    if failures:
        raise DocsError(f"{len(failures)} failing block(s) in {page.name}:\n\n" + "\n\n".join(failures))
    return notes


def run_block(block: Block, cwd: Path, notes: list[str]) -> None:
    if block.lang not in LANGUAGES:
        shown = block.lang or "(none)"
        raise DocsError(f"{block.where}: fence language {shown}: use one of {', '.join(LANGUAGES)}")
    if block.skip is not None:
        if not SKIP_REASON.search(block.skip):
            raise DocsError(f"{block.where}: 'skip' is only for missing hardware (GPU, nodes); got {block.skip!r}")
        notes.append(f"{block.where}: skipped: {block.skip}")
        return
    if block.ranks is not None and (block.lang != "python" or block.file):
        raise DocsError(f"{block.where}: ranks= is for python blocks that run")
    if block.parse and block.lang not in SHELL:
        raise DocsError(f"{block.where}: parse is for shell blocks")
    if block.lang == "json":
        check_json(block)
    elif block.lang == "yaml":
        try:
            yaml.safe_load(block.text)
        except yaml.YAMLError as exc:
            raise DocsError(f"{block.where} (yaml block): does not parse: {exc}") from None
    if block.file is not None:
        target = cwd / block.file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text, encoding="utf-8")
        return
    if block.lang == "python":
        run_python(block, cwd)
    elif block.lang in SHELL:
        if block.parse:
            parse_shell(block, cwd, notes)
        else:
            run_shell(block, cwd)


@pytest.fixture
def fresh_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ds_docs_") as d:
        yield Path(d)


# --------------------------------------------------------------------------------------------- tests


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page(page: Path, fresh_dir: Path) -> None:
    failure, notes = None, []
    try:
        notes = run_page(page, fresh_dir)
    except DocsError as exc:
        failure = str(exc)
    if failure is not None:  # outside the except: no chained duplicate of the message
        pytest.fail(failure, pytrace=False)
    for note in notes:
        warnings.warn(f"docs {note}", UserWarning, stacklevel=1)  # listed in pytest's warnings summary


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return page


def test_failure_names_the_line_and_shows_output(tmp_path: Path) -> None:
    page = _page(tmp_path, "# t\n\n```python\nprint('ok')\n```\n\n```python\nprint('boom'); raise SystemExit(3)\n```\n")
    with pytest.raises(DocsError, match=r"page\.md:7 \(python block\): exit code 3\nboom"):
        run_page(page, tmp_path)


def test_every_block_is_classified(tmp_path: Path) -> None:
    with pytest.raises(DocsError, match="fence language \\(none\\)"):
        run_page(_page(tmp_path, "```\nx\n```\n"), tmp_path)
    with pytest.raises(DocsError, match="fence language rust"):
        run_page(_page(tmp_path, "```rust\nfn main() {}\n```\n"), tmp_path)
    with pytest.raises(DocsError, match="only for missing hardware"):
        run_page(_page(tmp_path, "<!-- snippet: skip too slow -->\n```python\npass\n```\n"), tmp_path)
    with pytest.raises(DocsError, match="unknown snippet directive"):
        run_page(_page(tmp_path, "<!-- snippet: fiel=a.py -->\n```python\npass\n```\n"), tmp_path)


def test_files_shell_state_and_prompts(tmp_path: Path) -> None:
    text = (
        "<!-- snippet: file=a.py -->\n```python\nimport sys\nprint('hello', sys.argv[1])\n```\n"
        "```console\n$ export WHO=you\n$ python a.py \\\n    $WHO > out.txt\nhello you (output, ignored)\n```\n"
        "```bash\ngrep -q 'hello you' out.txt  # the export and the file carried over\n```\n"
    )
    assert run_page(_page(tmp_path, text), tmp_path) == []
    assert (tmp_path / "out.txt").read_text() == "hello you\n"
    with pytest.raises(DocsError, match=r"failed: page\.md:3\n"):
        run_page(_page(tmp_path, "```bash\ntrue\nfalse\n```\n"), tmp_path)
    with pytest.raises(DocsError, match=r"failed: page\.md:4: test \$WHO = y"):
        run_page(_page(tmp_path, "```console\n$ WHO=x\n$ true\n$ test \\\n  $WHO = y\n```\n"), tmp_path)
    heredoc = "```bash\ncat > h.txt <<EOF\nline\nEOF\ngrep -q line h.txt\n```\n"
    run_page(_page(tmp_path, heredoc), tmp_path)


def test_json_ds_config_is_validated(tmp_path: Path) -> None:
    run_page(_page(tmp_path, '```json\n{"zero_optimization": {"stage": 2}}\n```\n'), tmp_path)
    with pytest.raises(DocsError, match="a ds_config"):
        run_page(_page(tmp_path, '```json\n{"zero_optimization": {"stag": 2}}\n```\n'), tmp_path)
    with pytest.raises(DocsError, match="does not parse"):
        run_page(_page(tmp_path, '```json\n{"a": 1,}\n```\n'), tmp_path)


def test_parse_mode_checks_without_running(tmp_path: Path) -> None:
    ok = "<!-- snippet: parse -->\n```bash\nds-launch --num_gpus 8 -H hostfile train.py --x\nsrun -N 2 foo\n```\n"
    notes = run_page(_page(tmp_path, ok), tmp_path)
    assert any("srun" in n for n in notes) or shutil.which("srun")
    with pytest.raises(DocsError, match="ds-launch flags"):
        run_page(_page(tmp_path, "<!-- snippet: parse -->\n```bash\nds-launch --num_gpu 2 train.py\n```\n"), tmp_path)
    with pytest.raises(DocsError, match="pytest path tests/nope does not exist"):
        text = "<!-- snippet: parse -->\n```bash\npython -m pytest -k x tests/docs tests/nope\n```\n"
        run_page(_page(tmp_path, text), tmp_path)
    with pytest.raises(DocsError, match="nox session 'nope'"):
        run_page(_page(tmp_path, "<!-- snippet: parse -->\n```bash\nnox -s nope\n```\n"), tmp_path)


def test_index_lists_every_page() -> None:
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    missing = [p.name for p in PAGES if p.name != "index.md" and f"({p.name})" not in index]
    assert not missing, f"docs/index.md does not link these pages: {missing}"


def test_a_shell_launcher_gets_a_free_port_unless_the_page_sets_one(tmp_path: Path) -> None:
    """Two pages (or a page and a test) running at once must not both take ds-launch's / torchrun's default
    29500: in shell blocks both start with --master_port from this worker's range; the page's own, after
    it, wins (argparse keeps the last)."""
    from ds_strategy.launcher.cli import parse_args

    run_page(_page(tmp_path, "```bash\ndeclare -f ds-launch torchrun > launchers.txt\n```\n"), tmp_path)
    found = re.findall(r'command (\S+) --master_port (\d+) "\$@"', (tmp_path / "launchers.txt").read_text())
    assert [prog for prog, _ in found] == ["ds-launch", "torchrun"]
    assert 10000 <= int(found[0][1]) < 29000
    assert parse_args(["--master_port", found[0][1], "--master_port", "29612", "x.py"]).master_port == 29612


def test_a_block_of_plain_python_commands_runs_them_in_the_host_and_stops_at_the_first_failure(
    tmp_path: Path,
) -> None:
    page = _page(
        tmp_path,
        "```bash\npython -c 'print(1)'   # a comment\n"
        "PROBE=2 python -c \"import os; print(os.environ['PROBE'])\"\n```\n"
        "```bash\npython -c 'print(3)' | cat\n```\n"
        "```bash\npython -c 'raise SystemExit(4)'\npython -c 'open(\"ran\", \"w\")'\n```\n",
    )
    first, piped, failing = extract_blocks(page)
    assert [(env, argv[1:]) for _, env, argv in python_commands(first) or []] == [
        ({}, ["-c", "print(1)"]),
        ({"PROBE": "2"}, ["-c", "import os; print(os.environ['PROBE'])"]),
    ]
    assert python_commands(piped) is None  # bash runs it
    with pytest.raises(DocsError, match="exit code 4"):
        run_shell(failing, tmp_path)
    assert not (tmp_path / "ran").exists()
