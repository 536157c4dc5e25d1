"""``ds_strategy.profiling``: DeepSpeed's flops profiler (``FlopsProfiler``, ``get_model_profile``) over
torch's own flop counter, and the peak-flops table behind the MFU of the progress line (docs/profiling.md)."""

from .model_profile import get_model_profile
from .peak import PEAK_TABLE, mfu, peak_flops, set_peak_tflops, table_peak_tflops
from .profiler import FlopsProfiler
from .throughput import SpeedMeter, batch_tokens
from .units import duration_to_string, flops_to_string, macs_to_string, number_to_string, params_to_string

__all__ = [
    "PEAK_TABLE",
    "FlopsProfiler",
    "SpeedMeter",
    "batch_tokens",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "mfu",
    "number_to_string",
    "params_to_string",
    "peak_flops",
    "set_peak_tflops",
    "table_peak_tflops",
]
