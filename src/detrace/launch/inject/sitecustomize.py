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

        if not arm_from_env():
            return
    except Exception as err:  # the program must run on; say why it is not traced, here and to the launcher
        reason = str(err) or type(err).__name__
        print(f"detrace: the tracer was not started in process {os.getpid()}: {reason}", file=sys.stderr)
        try:
            from detrace.launch.inject import note_untraced

            note_untraced(reason)
        except Exception:  # the line above said it already; the launcher then finds no note
            pass
        return
    # `detrace audit` arms its probe beside the tracer (detrace.investigate.audit.records.ENV_AUDIT). Armed here, not
    # by the tracer: the recording wing does not import the investigation wing.
    if os.environ.get("DETRACE_AUDIT"):
        try:
            from detrace.investigate.audit.probe import arm_from_env as arm_audit

            arm_audit()
        except Exception as err:  # the program runs on, traced, without the audit
            reason = str(err) or type(err).__name__
            print(f"detrace: the audit was not armed in process {os.getpid()}: {reason}", file=sys.stderr)


class _ArmingLoader(importlib.abc.Loader):
    """Loads a module with its own loader, then arms the tracer once torch is loaded and no detrace module is still
    loading. Why wait for detrace's modules: a program that imports one of them before torch (`python -m
    detrace.examples.train` imports detrace._compat, which imports torch) would have the tracer's own imports meet
    that module half-made (a circular import); the tracer is armed as soon as the outermost one is complete."""

    def __init__(self, inner, watch, counted):
        self._inner = inner
        self._watch = watch
        self._counted = counted  # a detrace module (torch's own load is not counted)

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._watch.loading += self._counted
        try:
            self._inner.exec_module(module)
        finally:
            self._watch.loading -= self._counted
        self._watch.arm_when_ready()

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _WhenTorchLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: until the tracer is armed, it wraps the loaders of torch and of detrace's modules (see
    `_ArmingLoader`), then steps aside."""

    def __init__(self):
        self.loading = 0
        """detrace modules being loaded now."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" and fullname.partition(".")[0] != "detrace":
            return None
        for finder in sys.meta_path:  # the finders after this one, as the import system would ask them
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ArmingLoader(spec.loader, self, fullname != "torch")
                return spec
        return None

    def arm_when_ready(self):
        if self.loading == 0 and "torch" in sys.modules and self in sys.meta_path:
            sys.meta_path.remove(self)
            _arm()


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
