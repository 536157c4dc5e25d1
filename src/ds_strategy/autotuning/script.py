"""What each rank runs under ``ds-launch --autotuning tune|run``: the user's script, tuned inside ``initialize``.

    python -u -m ds_strategy.autotuning.script --mode tune|run [--module] script.py [script args...]

The script runs unchanged in this process (``runpy``, as ``python script.py`` would run it) while an
interceptor waits on ``ds_strategy.initialize`` (runtime/initialize.py, [Note: the initialize hook]). Its
first ``initialize(model=..., training_data=..., config=...)`` call is the tune (launch.py): ``tune`` writes
the results and ends every rank with status 0; ``run`` hands the script the engine of the winner and the
script trains on. A script that never calls ``initialize`` ends with an error that says so.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Sequence

from ds_strategy.runtime.initialize import intercepted

from .launch import MODES, AutotuneInterceptor


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_strategy.autotuning.script", allow_abbrev=False)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--module", action="store_true", help="the script is a module (python -m MODULE)")
    parser.add_argument("user_script")
    parser.add_argument("user_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    interceptor = AutotuneInterceptor(ns.mode)
    sys.argv = [ns.user_script, *ns.user_args]
    with intercepted(interceptor):
        if ns.module:
            runpy.run_module(ns.user_script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(ns.user_script)))
            runpy.run_path(ns.user_script, run_name="__main__")
    if not interceptor.called:
        sys.exit(
            f"ds-launch --autotuning {ns.mode}: {ns.user_script} finished without calling ds_strategy.initialize(); "
            "the tune runs inside that call (a Lightning script tunes with ds_strategy.lightning.ZeroTuner instead)"
        )


if __name__ == "__main__":
    main()
