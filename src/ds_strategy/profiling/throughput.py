"""Throughput of training: samples/s, tokens/s and MFU between two readings.

Tokens of a batch: the number of elements of the first integer tensor among the forward's inputs
(positional arguments first, then keyword arguments, depth-first through lists, tuples and dicts), e.g.
``input_ids`` of shape (batch, sequence). A forward without an integer tensor counts no tokens.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from .peak import mfu


def batch_tokens(*values: Any) -> int | None:
    """numel of the first integer (not bool) tensor found in ``values``, or None."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool:
                return value.numel()
        elif isinstance(value, Mapping):
            found = batch_tokens(*value.values())
            if found is not None:
                return found
        elif isinstance(value, (list, tuple)):
            found = batch_tokens(*value)
            if found is not None:
                return found
    return None


class SpeedMeter:
    """Rates since the previous reading (the first reading: since construction)."""

    def __init__(self) -> None:
        self._t = time.perf_counter()
        self._samples = 0
        self._tokens = 0

    def read(
        self,
        samples: int,
        tokens: int,
        *,
        flops_per_sample: float | None = None,
        peak_per_device: float | None = None,
        devices: int = 1,
    ) -> dict[str, float]:
        """``samples`` / ``tokens``: running totals over all ranks. Returns samples_per_sec, and
        tokens_per_sec when tokens were counted, and tflops (achieved, all devices) and mfu (a fraction)
        when the flops per sample are known (and the peak, for mfu)."""
        now = time.perf_counter()
        elapsed = max(now - self._t, 1e-9)
        out = {"samples_per_sec": (samples - self._samples) / elapsed}
        if tokens > self._tokens:
            out["tokens_per_sec"] = (tokens - self._tokens) / elapsed
        if flops_per_sample is not None:
            achieved = out["samples_per_sec"] * flops_per_sample
            out["tflops"] = achieved / 1e12
            if peak_per_device is not None:
                out["mfu"] = mfu(achieved, peak_per_device, devices)
        self._t, self._samples, self._tokens = now, samples, tokens
        return out
