"""Fixtures shared by the test modules, and the process-wide state every test gets back as it found it."""

from __future__ import annotations

import fcntl
import functools
import gc
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

# The tiers' shared helpers (synthetic traces, rank spawning, scenarios) live in tests/support.
sys.path.insert(0, str(Path(__file__).parent / "support"))

from _ranks import free_port as _free_port
from _scenarios import STEADY, traced_runs
from _tiers import is_quick, run_order
from _tools import CHROMIUM, missing_browser

# A forked child (a DataLoader worker) must not inherit garbage that holds a gloo process group: a test that ran one in
# this process and left a group to the collector (a DeviceMesh, a module, a cycle) would have the child collect it,
# and ~ProcessGroupGloo waits there for ever on its worker threads, which a fork does not copy (seen at torch 2.10 and
# 2.13: the worker hung in test_streams). Collected in the parent before a test's first fork (the garbage of the tests
# before it), where those threads still run; once a test, since a full collection costs 0.2 s in a worker that has
# imported transformers and Lightning, and a DataLoader forks each worker of each epoch.
_FORK = {"collected": False}


def _collect_before_the_first_fork() -> None:
    if not _FORK["collected"]:
        gc.collect()
        _FORK["collected"] = True


os.register_at_fork(before=_collect_before_the_first_fork)

if not torch.cuda.is_available():
    # Triton picks its interpreter when `triton.jit` decorates a function, its own library's included: set before
    # anything (Inductor in the compiled tests, detrace.ops) imports triton, or the Triton tests depend on order.
    os.environ.setdefault("TRITON_INTERPRET", "1")

_INDUCTOR_OPTIONS = ("deterministic", "max_autotune", "coordinate_descent_tuning")


# The suite runs on several pytest-xdist workers (pyproject.toml's addopts), a test at a time each, but for the tests of
# a file that defines a module-scoped fixture: one worker runs them all and makes the fixture once. A test marked
# `race` asserts that a real CPU race strikes: its two threads must overlap in time, which a busy second core delays
# by a step or more (the first divergence that docs quote moves). Such a test runs alone on the machine: it holds the
# machine lock exclusively, every other test holds it shared. They run first, together, so that no worker waits long;
# then the real-process tests, the slowest tier first, then the in-process ones, so that the last tests to run are
# short ones (tests/support/_tiers.run_order).
# Each test of the quick tier (tests/support/_tiers.py) is marked `quick` here, before `-m` selects: first.

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    browser = missing_browser(CHROMIUM, os.environ)
    for item in items:
        if is_quick(item.nodeid, (mark.name for mark in item.iter_markers())):
            item.add_marker(pytest.mark.quick)
        if browser is not None and not browser[0] and item.get_closest_marker("browser") is not None:
            # a skip mark, not pytest.skip() in a hook: the summary then names the test, not this file's line
            item.add_marker(pytest.mark.skip(reason=f"{item.name} {browser[1]}"))
    items.sort(key=lambda item: run_order(item.path.parts, (mark.name for mark in item.iter_markers())))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's scheduling by scope, in the order the workers collected (--no-loadscope-reorder): each test a scope of
    its own, but for the files that define a module-scoped fixture. (xdist's own `loadgroup` no longer groups under
    pytest 9.2, which keeps node ids apart from the suffix it appends: pytest-xdist issue 1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByTestOrFixtureFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _defines_a_module_fixture(config.rootpath / path) else nodeid

    return ByTestOrFixtureFile(config, log)


@functools.cache
def _defines_a_module_fixture(path: Path) -> bool:
    return 'scope="module"' in path.read_text()


_MACHINE = "DETRACE_TESTS_MACHINE"
"""The folder of the machine lock: made by the controlling pytest process, inherited by its workers."""


_ROOM = pytest.StashKey[str]()
"""The machine lock's folder this pytest process made (a pytest run inside a test inherits its parent's)."""


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ[_MACHINE] = config.stash[_ROOM] = tempfile.mkdtemp(prefix="detrace-tests-")


def pytest_unconfigure(config: pytest.Config) -> None:
    # Only the folder this process made: a pytest run inside a test (test_suite_browser's, with -n 0) removed its
    # parent's, and the parent's next test to begin crashed its worker (FileNotFoundError: .../turnstile).
    room = config.stash.get(_ROOM, None)
    if room is not None:
        os.environ.pop(_MACHINE, None)
        shutil.rmtree(room, ignore_errors=True)


@contextmanager
def _machine(room: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold the machine shared, or alone. A writer first holds the turnstile, which every test passes on its way in,
    so that shared holders cannot keep a race test waiting for ever."""
    with open(room / "turnstile", "a") as turnstile, open(room / "machine", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    _FORK["collected"] = False  # before its fixtures, which may fork too (a module's, set up for its first test)
    if _MACHINE not in os.environ:  # one process: nothing to share
        yield
        return
    with _machine(Path(os.environ[_MACHINE]), exclusive=item.get_closest_marker("race") is not None):
        yield


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `browser` fails in CI without the browser (see _tools.missing_browser); elsewhere it is skipped,
    saying how to install it (marked so in pytest_collection_modifyitems)."""
    if item.get_closest_marker("browser") is None:
        return
    missing = missing_browser(CHROMIUM, os.environ)
    if missing is not None and missing[0]:
        pytest.fail(f"{item.name} {missing[1]}")


@pytest.fixture(autouse=True)
def _process_state_restored() -> Iterator[None]:
    """detrace.deterministic(), the fault injector and the replica guard change process-wide state on purpose;
    a test that calls them in-process must not hand that state to the tests after it. Restores torch's
    determinism flags, its thread count, Inductor's determinism options and the environment."""
    environ = dict(os.environ)
    flags = (
        torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(), torch.get_num_threads(),
    )
    inductor = sys.modules.get("torch._inductor.config")
    options = {option: getattr(inductor, option) for option in _INDUCTOR_OPTIONS} if inductor else {}
    yield
    torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
    torch.utils.deterministic.fill_uninitialized_memory = flags[2]  # type: ignore[attr-defined]
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[3], flags[4]
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags[5], flags[6]
    torch.set_float32_matmul_precision(flags[7])
    torch.set_num_threads(flags[8])
    for option, value in options.items():
        setattr(inductor, option, value)
    # Only the variables the test changed are put back: clearing the whole environment and setting it again calls
    # unsetenv/setenv on every variable while threads the test left behind (Inductor's compile pool, thread pools of
    # the code under test) may read the environment, which glibc does not make safe (a segfault, seen at torch 2.10).
    for name in [name for name in os.environ if name not in environ]:
        del os.environ[name]
    for name, value in environ.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    """A function giving a TCP port that was free on 127.0.0.1 a moment ago: call it once per rendezvous."""
    return _free_port


@pytest.fixture(scope="session")
def steady_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Read-only: two deterministic runs of tests/support/scripts/train_gather.py (a, b: bit-identical, 3 steps,
    rung semantic) and one with a changed learning rate (lr). Shared by the report and compare tests, and made once
    for the whole run: the first worker that needs them makes them, the others wait for it and read them."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # the run's folder, which holds each worker's own
    folder = shared / "steady"
    with open(shared / "steady.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "made").exists():
            return {name: folder / name for name in ("a", "b", "lr")}
        runs = traced_runs(folder, ("a", STEADY), ("b", STEADY), ("lr", [*STEADY, "--lr=0.02"]))
        (folder / "made").touch()
        return runs


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A default process group of one gloo rank (this process), destroyed after the test: what torch's FSDP,
    DTensor and pipeline APIs need to run in process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
