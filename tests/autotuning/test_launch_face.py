"""``ds-launch --autotuning tune|run script.py`` (issue 44, criterion 1): the launcher's wrapped command, the
``initialize`` hook it relies on, the interceptor's refusals, and both modes end to end on 2 CPU ranks.

Every launched process runs under a subprocess timeout, so a broken tune fails these tests instead of
hanging them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_strategy.autotuning.launch import AutotuneInterceptor, dataset_batches, optimizer_factory, require_enabled
from ds_strategy.launcher.cli import parse_args
from ds_strategy.launcher.launch import AUTOTUNING_MODULE, with_autotuning
from ds_strategy.launcher.local import worker_command
from ds_strategy.launcher.runners import RemoteJob, openmpi_commands, ssh_commands
from tests.harness import run_distributed
from tests.launcher.common import LAUNCH, env, free_port

TIMEOUT = 240

# The user's script, unchanged from a plain DeepSpeed-style one: initialize(model, training_data, config) and
# a loop over the loader it returns. It records the engine's micro batch and losses per rank.
SCRIPT = """
import json
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import ds_strategy


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width=16, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(x, y)


out = sys.argv[1]
torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 16), torch.randn(64, 16))
config = {
    "train_batch_size": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "autotuning": {
        "enabled": ENABLED,
        "fast": True,
        "start_profile_step": 1,
        "end_profile_step": 2,
        "num_tuning_micro_batch_sizes": 2,
        "tuner_num_trials": 3,
        "results_dir": out + "/results",
        "exps_dir": out + "/exps",
    },
}
engine, _, loader, _ = ds_strategy.initialize(model=Net(), training_data=data, config=config)
losses = []
for x, y in loader:
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
with open(out + "/rank" + str(engine.global_rank) + ".json", "w") as f:
    json.dump({"micro_batch": engine.train_micro_batch_size_per_gpu(), "losses": losses, "argv": sys.argv[1:]}, f)
"""


def _script(tmp_path: Path, enabled: bool = True) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.replace("ENABLED", str(enabled)))
    return path


def _launch(tmp_path: Path, mode: str, script: Path) -> subprocess.CompletedProcess[str]:
    cmd = [*LAUNCH, "--num_procs", "2", "--master_port", str(free_port()), "--autotuning", mode, str(script)]
    return subprocess.run(
        [*cmd, str(tmp_path)], env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=TIMEOUT
    )


# ---------------------------------------------------------------- the launcher's command


@pytest.mark.parametrize("mode", ["tune", "run"])
def test_the_launcher_runs_the_script_under_the_autotuner(mode: str) -> None:
    args = with_autotuning(parse_args(["--autotuning", mode, "train.py", "--lr", "1"]))
    assert worker_command(args.user_script, args.user_args, module=args.module, local_rank="0") == (
        sys.executable,
        "-u",
        "-m",
        AUTOTUNING_MODULE,
        "--mode",
        mode,
        "train.py",
        "--lr",
        "1",
        "--local_rank=0",
    )
    # A module script keeps --module, handed to the autotuner's runner.
    module = with_autotuning(parse_args(["--autotuning", mode, "--module", "pkg.train"]))
    assert module.user_args == ("--mode", mode, "--module", "pkg.train") and module.module
    # Without the flag nothing changes.
    plain = parse_args(["train.py"])
    assert with_autotuning(plain) is plain and plain.autotuning is None


def test_multi_host_launchers_run_the_wrapped_module() -> None:
    from ds_strategy.launcher.hostfile import resolve_plan

    args = with_autotuning(parse_args(["--autotuning", "run", "train.py", "x"]))
    job = RemoteJob(
        plan=resolve_plan({"a": 1, "b": 1}),
        master_addr="a",
        master_port=29500,
        user_script=args.user_script,
        user_args=args.user_args,
        module=args.module,
    )
    ssh = ssh_commands(job)[0].argv[-1]
    assert f"--module {AUTOTUNING_MODULE} --mode run train.py x" in ssh
    mpirun = openmpi_commands(job)[0].argv
    tail = ("ds_strategy.launcher.bootstrap", "--module", AUTOTUNING_MODULE, "--mode", "run", "train.py", "x")
    assert mpirun[-len(tail) :] == tail


def test_autotuning_refuses_no_python(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--autotuning", "tune", "--no_python", "train.sh"])
    assert exc.value.code == 2
    assert "--autotuning runs the script in Python" in capsys.readouterr().err


# ---------------------------------------------------------------- the hook and the interceptor


def _hooked(rank: int, world: int) -> dict[str, Any]:
    from ds_strategy.runtime import initialize as runtime_init
    from ds_strategy.runtime.initialize import initialize, intercepted

    seen: dict[str, Any] = {}

    def hook(arguments: dict[str, Any]) -> Any:
        seen.update(arguments)
        # Inside the hook initialize is the real one: this builds an engine.
        engine, *_ = initialize(model=arguments["model"], config=arguments["config"])
        return ("hooked", type(engine).__name__)

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with intercepted(hook):
        got = initialize(model=nn.Linear(2, 2), config_params=config, collate_fn=None)
    module_state = sys.modules["ds_strategy.runtime.initialize"]._interceptor  # type: ignore[attr-defined]
    engine, *_ = runtime_init(model=nn.Linear(2, 2), config=config)  # the package's name: the same function
    return {
        "got": got,
        "keys": sorted(seen),
        "config": seen["config"],
        "after": module_state,
        "plain": type(engine).__name__,
    }


@pytest.mark.multiprocess
def test_intercepted_routes_initialize_and_reentry_is_real() -> None:
    (out,) = run_distributed(_hooked, 1)
    assert out["got"] == ("hooked", "ZeroEngine")
    assert out["keys"] == sorted(
        [
            "args",
            "model",
            "optimizer",
            "model_parameters",
            "training_data",
            "lr_scheduler",
            "config",
            "collate_fn",
            "dist_init_required",
            "process_group",
            "device",
            "mpu",
        ]
    )
    assert out["config"]["train_micro_batch_size_per_gpu"] == 1  # config_params resolved into config
    assert out["after"] is None and out["plain"] == "ZeroEngine"


def test_require_enabled_names_the_key_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    with pytest.raises(ValueError, match=re.escape(f"autotuning.enabled is not true in {path}:")):
        require_enabled(str(path), "ds-launch --autotuning tune")
    with pytest.raises(ValueError, match=r"autotuning\.enabled is not true in the config dict given to initialize"):
        require_enabled({"autotuning": {"enabled": False}}, "ds-launch --autotuning run")
    require_enabled({"autotuning": {"enabled": True}}, "x")


def test_interceptor_needs_training_data() -> None:
    arguments = dict.fromkeys(
        ("args", "optimizer", "model_parameters", "training_data", "lr_scheduler", "collate_fn", "device"), None
    )
    arguments.update(model=nn.Linear(2, 2), config={"autotuning": {"enabled": True}}, process_group=None, mpu=None)
    with pytest.raises(ValueError, match=r"without training_data.*initialize\(training_data=dataset"):
        AutotuneInterceptor("tune")(arguments)


def test_optimizer_instance_becomes_a_factory_and_data_keeps_its_collate() -> None:
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5)
    make = optimizer_factory(opt)
    fresh = make(nn.Linear(3, 3).parameters())
    assert type(fresh) is torch.optim.SGD and fresh.defaults["lr"] == 0.25 and fresh.defaults["momentum"] == 0.5
    assert optimizer_factory(None) is None
    # torch's AdamW keeps a key in its defaults its constructor does not take: it is left out.
    adamw = optimizer_factory(torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.2))(model.parameters())
    assert type(adamw) is torch.optim.AdamW and (adamw.defaults["lr"], adamw.defaults["weight_decay"]) == (0.5, 0.2)
    dataset = [torch.full((2,), float(i)) for i in range(5)]
    assert dataset_batches(dataset) is dataset  # collated the default way by the autotuner itself
    batches = dataset_batches(dataset, lambda samples: {"x": torch.stack(samples)})
    assert torch.equal(batches(2, 2)["x"][:, 0], torch.tensor([4.0, 0.0]))  # step 2 of rank 0: samples 4, 5 % 5


# ---------------------------------------------------------------- end to end on 2 CPU ranks


@pytest.mark.slow
def test_tune_writes_the_winner_and_every_rank_exits_0(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "tune", _script(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    written = json.loads((tmp_path / "results" / "ds_config.json").read_text())
    best = json.loads((tmp_path / "results" / "best.json").read_text())
    assert written["train_micro_batch_size_per_gpu"] == best["micro_batch"]
    assert written["train_batch_size"] == 8 and "autotuning" not in written
    assert "the best configuration is" in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("rank*.json"))  # tune stops before the script trains


@pytest.mark.slow
def test_run_trains_with_the_winner(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "run", _script(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    best = json.loads((tmp_path / "results" / "best.json").read_text())
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["micro_batch"] == best["micro_batch"]
        # 64 samples, 2 ranks, the winner's micro batch: every batch of this rank's half trained.
        assert len(record["losses"]) == 32 // best["micro_batch"]
        assert all(torch.isfinite(torch.tensor(record["losses"])))
        assert record["argv"][0] == str(tmp_path)  # the script's own arguments (then --local_rank)


@pytest.mark.slow
def test_a_config_without_autotuning_enabled_fails_with_the_key(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "tune", _script(tmp_path, enabled=False))
    assert proc.returncode != 0
    assert "autotuning.enabled is not true in the config dict given to initialize()" in proc.stderr
