"""Ship the kernel sources inside the wheel (as ds_strategy/_csrc) so an installed package can build them
on first use; everything else about the package lives in pyproject.toml."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernelSources(build_py):
    def run(self) -> None:
        super().run()
        source = Path(__file__).resolve().parent / "csrc"
        target = Path(self.build_lib) / "ds_strategy" / "_csrc"
        if source.is_dir():
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.o", "*.so", "build"))


setup(cmdclass={"build_py": BuildPyWithKernelSources})
