"""The one compiled module, the list scheduler's loop (schedcomp/solvers/greedy_native.py); everything else is
in pyproject.toml. Optional: without a C compiler the install goes on and the Python loop runs. No fused
multiply-add: the loop must round exactly as the Python loop does."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("schedcomp.solvers._listloop", ["schedcomp/solvers/_listloop.c"], optional=True,
                             extra_compile_args=["-O2", "-ffp-contract=off", "-fno-fast-math"])])
