"""RNG states of one rank (torch CPU, CUDA, Python ``random``, NumPy) as tensors and plain values, so that
they pass ``torch.load(weights_only=True)`` (NumPy's state holds an ndarray, Python's a long tuple)."""

from __future__ import annotations

import random
from typing import Any

import torch


def capture() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": None,
    }
    try:
        import numpy as np
    except ImportError:
        return state
    saved: Any = np.random.get_state()  # the legacy tuple form
    kind, keys, pos, has_gauss, cached = saved
    state["numpy"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    saved_np = state.get("numpy")
    if saved_np is None:
        return
    try:
        import numpy as np
    except ImportError:
        return
    np.random.set_state(
        (
            saved_np["kind"],
            saved_np["keys"].numpy().astype(np.uint32),
            saved_np["pos"],
            saved_np["has_gauss"],
            saved_np["cached_gaussian"],
        )
    )
