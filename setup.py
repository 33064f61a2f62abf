"""Builds the small C++ core (neuronlocal._C) against the installed torch.

Install with `pip install --no-build-isolation -e .` so the build uses the torch in the
environment (pinned to 2.13.0 by constraints.txt) instead of downloading another one.
"""
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

csrc = Path("src/neuronlocal/csrc")
setup(
    ext_modules=[
        CppExtension(
            "neuronlocal._C",
            sorted(str(p) for p in csrc.glob("*.cpp")),
            extra_compile_args=["-O2", "-std=c++20", "-Wno-unused-parameter"],
        )
    ],
    # ninja (requirements.txt) compiles the files in parallel; without it, one by one.
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
