"""The examples: LightningCLI YAML in both forms, a real script launch, and the notebook run headlessly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import ds_strategy.lightning as zl

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CONFIGS = ["cli_zero2.yaml", "cli_zero_config.yaml"]


@pytest.fixture
def cli_main(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.chdir(ROOT)  # the YAML names examples/ds_config.json relative to the repository root
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # LightningCLI warns when args= and sys.argv both carry arguments
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import cli  # examples/cli.py

    return cli.main


def _print_config(cli_main: Any, config: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(["fit", "--config", str(config), "--print_config"])
    assert info.value.code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("name", CONFIGS)
def test_print_config_round_trips(name: str, cli_main: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    printed = _print_config(cli_main, EXAMPLES / name, capsys)
    strategy = yaml.safe_load(printed)["trainer"]["strategy"]
    if name == "cli_zero2.yaml":
        assert strategy == "zero2"
    else:
        assert strategy["class_path"] == "ds_strategy.lightning.ZeroStrategy"
        assert strategy["init_args"]["stage"] == 2 and strategy["init_args"]["config"] == "examples/ds_config.json"
    again = tmp_path / "printed.yaml"
    again.write_text(printed)
    assert _print_config(cli_main, again, capsys) == printed


@pytest.mark.parametrize("name", CONFIGS)
def test_yaml_builds_the_strategy(name: str, cli_main: Any) -> None:
    cli = cli_main(["--config", str(EXAMPLES / name)], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, zl.ZeroStrategy) and strategy.stage == 2
    if name == "cli_zero_config.yaml":
        assert strategy.raw_config["zero_optimization"]["reduce_bucket_size"] == 500000  # from ds_config.json
        assert strategy.precision_plugin.precision == "bf16-mixed"


@pytest.mark.slow
def test_cli_script_launch() -> None:
    """A real launch: Lightning's subprocess launcher re-runs the command for rank 1."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("LOCAL_RANK", None)
    args = [
        sys.executable,
        "examples/cli.py",
        "fit",
        "--config",
        "examples/cli_zero_config.yaml",
        "--trainer.max_epochs=1",
        "--trainer.enable_progress_bar=false",
    ]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        # 192 training rows / 2 ranks / batch 8 = 12 micro-batches, accumulate 2: 6 optimizer steps.
        assert f"rank {rank}/2: 6 steps with ZeroStrategy(stage=2)" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_notebook_forks_two_ranks(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/notebook_zero.ipynb in a real kernel: its cells assert 2 forked ranks trained and the
    kernel's model holds the trained weights (under stage 3: the gathered full weights)."""
    monkeypatch.setenv("DS_NOTEBOOK_STRATEGY", name)
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(EXAMPLES / "notebook_zero.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    text = "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))
    assert "the kernel's model holds the weights trained on 2 ranks" in text
