"""``get_model_profile``: the flops, MACs and parameters of one forward of a model (DeepSpeed's function)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from .profiler import FlopsProfiler
from .units import macs_to_string, number_to_string, params_to_string


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Iterable[type[nn.Module]] | None = None,
    mode: Literal["forward", "generate"] = "forward",
) -> tuple[int, int, int] | tuple[str, str, str]:
    """Run ``model`` ``warm_up`` times, then once under the profiler; return (flops, MACs, params).

    ``input_shape`` builds one input tensor of that shape (zeros, in the parameters' dtype and device) as
    the only positional argument; otherwise ``args`` / ``kwargs`` are passed. The model is put in eval mode
    as DeepSpeed does. ``mode="generate"`` profiles ``model.generate(...)`` instead of the forward.
    With ``as_string`` the three numbers come back formatted (``"1.2 G"``, ``"600 MMACs"``, ``"1.3 M"``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        args = [
            torch.zeros(
                input_shape,
                dtype=first.dtype if first is not None else None,
                device=first.device if first is not None else None,
            )
        ]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, args or kwargs (the model's inputs)")
    run = getattr(model, mode) if mode == "generate" else model
    model.eval()
    for _ in range(warm_up):
        run(*args, **kwargs)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        run(*args, **kwargs)
    finally:
        prof.stop_profile()
    flops, macs, params = int(prof.get_total_flops()), int(prof.get_total_macs()), int(prof.get_total_params())
    if print_profile:
        prof.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
