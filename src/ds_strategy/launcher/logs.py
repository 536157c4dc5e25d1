"""Per-rank log files for the elastic agent, named by global rank so several nodes can share a directory.

``<log_dir>/rank<R>.stdout.log`` and ``rank<R>.stderr.log`` (``rank<R>.attempt<k>.*`` after the k-th
restart), teed to the console with a ``[rank<R>]:`` prefix. On a failure the launcher prints the tail
of the failed rank's files.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs, Std


class RankLogs(LogsSpecs):
    """A ``LogsSpecs`` whose files are flat and named by global rank (torchrun nests them by local rank)."""

    def __init__(self, log_dir: str | Path) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(str(log_dir), redirects=Std.ALL, tee=Std.ALL)
        self.log_dir = Path(log_dir)
        # local rank -> (stdout path, stderr path) of the latest attempt, for the failure report.
        self.files: dict[int, tuple[Path, Path]] = {}

    @property
    def root_log_dir(self) -> str:
        return str(self.log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = LogsDest()
        self.files = {}
        for local_rank, env in envs.items():
            rank = env.get("RANK", str(local_rank))
            attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
            stem = f"rank{rank}" if attempt == 0 else f"rank{rank}.attempt{attempt}"
            out, err = self.log_dir / f"{stem}.stdout.log", self.log_dir / f"{stem}.stderr.log"
            error_file = self.log_dir / f"{stem}.error.json"
            error_file.unlink(missing_ok=True)  # a stale one would be reported as this run's error
            env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
            dest.stdouts[local_rank], dest.stderrs[local_rank] = str(out), str(err)
            dest.tee_stdouts[local_rank], dest.tee_stderrs[local_rank] = str(out), str(err)
            dest.error_files[local_rank] = str(error_file)
            self.files[local_rank] = (out, err)
        dest.filtered_stdout = os.devnull
        dest.filtered_stderr = os.devnull
        return dest


def tail(path: Path, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of a text file ([] when it is missing)."""
    try:
        with path.open(errors="replace") as fh:
            return [line.rstrip("\n") for line in deque(fh, maxlen=lines)]
    except OSError:
        return []
