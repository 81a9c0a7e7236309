"""detrace's start-up hook (see detrace/launch/inject/__init__.py). Inert and cheap unless DETRACE_TRACE is set.

It imports nothing heavy: torch and detrace are only imported once the program imports torch itself.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _arm():
    try:
        from detrace.record import arm_from_env

        arm_from_env()
    except Exception as err:  # the program must run on; say why it is not traced
        print(f"detrace: the tracer was not started in process {os.getpid()}: {err}", file=sys.stderr)


class _ArmingLoader(importlib.abc.Loader):
    """Loads torch with its own loader, then arms the tracer."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _arm()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _WhenTorchLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the first `import torch` it wraps torch's loader, then steps aside."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ArmingLoader(spec.loader)
        return spec


def _chain():
    """Run the sitecustomize this one shadows (a distribution's or a virtual environment's), if any."""
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is not None and spec.loader is not None and spec.origin != os.path.abspath(__file__):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("DETRACE_TRACE"):
    if "torch" in sys.modules:
        _arm()
    else:
        sys.meta_path.insert(0, _WhenTorchLoads())
_chain()
