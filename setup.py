"""The one thing pyproject.toml cannot say without an experimental table: detrace's C extension.

`detrace._fp1` is the CPU fingerprint kernel (src/detrace/_fp1.c, loaded by detrace.digest.native), compiled at install:
hash_tensor speed from a process's first call, with no JIT to load and no torch.compile pause. It is optional:
without a C compiler detrace installs all the same and fingerprints on the CPU with NumPy and eager kernels
(slower; `detrace doctor` says so).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("detrace._fp1", sources=["src/detrace/_fp1.c"], optional=True)])
