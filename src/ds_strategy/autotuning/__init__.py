"""The autotuner: the fastest ZeRO configuration that fits, found in-process with the global batch held.

``autotune(model_fn, data, config)`` (tune.py) profiles the model, lists the candidates (space.py), prunes
those the memory model puts over the cap, runs the rest as in-process trials (trial.py) in the tuner's order
(tuners.py) and reports (report.py). docs/autotuning.md is the guide.
"""

from __future__ import annotations

from .profile import ModelProfile, checkpoint_blocks
from .space import Candidate, SearchSpace
from .trial import TrialResult
from .tune import AutotuneResult, autotune, predict_peak

__all__ = [
    "AutotuneResult",
    "Candidate",
    "ModelProfile",
    "SearchSpace",
    "TrialResult",
    "autotune",
    "checkpoint_blocks",
    "predict_peak",
]
