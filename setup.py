"""The one thing pyproject.toml cannot say without an experimental table: detrace's C extensions.

`detrace._fp1` and `detrace._fp2` are the CPU fingerprint kernels of the two schemes (src/detrace/_fp1.c, _fp2.c,
loaded by detrace.digest.native), compiled at install: full speed from a process's first call, with no JIT to load
and no torch.compile pause. Each is optional:
without a C compiler detrace installs all the same and fingerprints on the CPU with NumPy and eager kernels
(slower; `detrace doctor` says so).
"""

from setuptools import Extension, setup

# depends: both include _fpkernel.h (their shared entry point); it ships in the sdist and a change to it rebuilds
setup(ext_modules=[Extension(f"detrace._{name}", sources=[f"src/detrace/_{name}.c"],
                             depends=["src/detrace/_fpkernel.h"], optional=True)
                   for name in ("fp1", "fp2")])
