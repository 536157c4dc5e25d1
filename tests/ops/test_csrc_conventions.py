"""Source rules of csrc/ that a compiler does not enforce (no nvcc or GPU needed to check them)."""

from __future__ import annotations

import re

from ds_strategy.ops.builder import csrc_root

LAUNCH = re.compile(r"<<<[^;]*>>>\([^;]*\);")
LAUNCH_CHECK = "C10_CUDA_KERNEL_LAUNCH_CHECK();"
DISPATCH_HEADER = csrc_root() / "includes" / "dispatch.h"


def test_every_cuda_launch_is_followed_by_a_launch_check() -> None:
    launches = 0
    for source in sorted(csrc_root().rglob("*.cu")):
        text = source.read_text()
        for match in LAUNCH.finditer(text):
            launches += 1
            after = text[match.end() :].lstrip()
            line = text.count("\n", 0, match.start()) + 1
            assert after.startswith(LAUNCH_CHECK), f"{source.name}:{line}: a launch without {LAUNCH_CHECK}"
    assert launches >= 4  # the norm (2) and Adam (2) launchers: the pattern still finds them


def test_aten_dtypes_become_kernel_dtypes_in_one_header() -> None:
    # A switch over at::ScalarType anywhere else is a copy of dispatch.h's kernel_dtype.
    copies = [
        f"{source.relative_to(csrc_root())}"
        for source in sorted(csrc_root().rglob("*"))
        if source.suffix in {".cpp", ".cu", ".h", ".cuh"}
        and source != DISPATCH_HEADER
        and re.search(r"case\s+(at|c10)::(kBFloat16|kHalf|kFloat|ScalarType::)", source.read_text())
    ]
    assert copies == []
    assert "kernel_dtype" in DISPATCH_HEADER.read_text()
