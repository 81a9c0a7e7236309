"""Small tools several test modules use: the CLI in a fresh process, a real headless browser, a flipped bit, an
example script loaded as a module, a folder's every entry and bytes."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import pytest
import torch


def locate_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -m detrace locate ARGS` in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "detrace", "locate", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout, check=False)


def load_script(path: Path) -> ModuleType:
    """The script at `path`, freshly executed as a module named after its file, and importable by that name as a
    script's __main__ is (Dynamo imports a compiled function's module to read its globals)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


RACING_THREADS = 8
"""The thread count of the tests whose race is their own (not a command the docs quote): more threads than this
project's machines have cores (2 to 4). Two threads on a busy 2-core machine often run one after the other, always in
the same order, and then agree bit for bit (issue 36); with more threads than cores, the order in which the operating
system runs them decides the order of the additions, and a busy machine makes that order vary."""

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
INSTALL_CHROMIUM = "sudo apt-get install chromium"
"""How a machine gets the headless browser the `browser` tests need (Debian's chromium)."""


INSTALL_TRITON = "pip install -e '.[triton]'"
"""How an environment gets the Triton interpreter the Triton kernels' tests need (the `triton` extra)."""


def missing_tool(present: bool, why: str, environ: Mapping[str, str]) -> tuple[bool, str] | None:
    """What becomes of a test that needs a tool CI installs (a browser, Triton): None where the tool is there; else
    (fail, why): skipped on a machine that lacks it (a fresh clone's), failed in CI (`CI` set, as CI services set it,
    and as .ci/run does), which installs it, so that those tests never go unchecked."""
    if present:
        return None
    ci = environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    return ci, why + ("; CI requires it" if ci else "")


def missing_browser(chromium: str | None, environ: Mapping[str, str]) -> tuple[bool, str] | None:
    """`missing_tool` for a test marked `browser` (tests/conftest.py)."""
    why = f"needs a headless browser, Debian's chromium, which this machine lacks (install it: {INSTALL_CHROMIUM})"
    return missing_tool(bool(chromium), why, environ)


def dump_dom(page: Path) -> str:
    """The page as a real headless browser renders it (no network: the report must not need it). A test that calls
    it is marked `browser`."""
    assert CHROMIUM, "a test that opens a page in the browser is marked browser (tests/conftest.py)"
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--dump-dom", page.resolve().as_uri()], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def flip_one_bit(directory: Path, tensor: torch.Tensor) -> None:
    """Flip one bit in the middle of `tensor`'s bytes where they are stored in a shard file."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    for shard in directory.glob("*.distcp"):
        content = bytearray(shard.read_bytes())
        at = content.find(data)
        if at >= 0:
            content[at + len(data) // 2] ^= 0x10
            shard.write_bytes(bytes(content))
            return
    raise AssertionError("the tensor's bytes are in no shard")


def close_loader_workers(loader: object) -> None:
    """Stop a torchdata StatefulDataLoader's workers now, for a loop that ends mid-epoch. The loader keeps its
    iterator: left to the cyclic garbage collector (where the loader sits in a reference cycle, as accelerate's
    prepared loaders do), that iterator's shutdown waits 5 s per worker, in whichever later test the collector runs."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def triton_tests() -> tuple[str, pytest.MarkDecorator]:
    """For a module of Triton kernel tests, called before it imports the kernels: Triton's CPU interpreter unless
    TRITON_INTERPRET says otherwise (the interpreter is chosen when triton.jit decorates a kernel), the module skipped
    where triton is not installed (the `triton` extra installs it), but failed in CI (`missing_tool`); returns the
    device the tests' tensors go to and the module's `pytestmark`, which skips its tests where there is neither a CUDA
    device nor the interpreter."""
    __tracebackhide__ = True  # a skip or failure is reported at the test module's call, not at a line here
    if not os.environ.get("TRITON_INTERPRET"):
        os.environ["TRITON_INTERPRET"] = "1"
    missing = missing_tool(importlib.util.find_spec("triton") is not None,
                           f"needs triton, whose CPU interpreter runs the kernels (install it: {INSTALL_TRITON})",
                           os.environ)
    if missing is not None:
        fail, why = missing
        if fail:
            pytest.fail(why, pytrace=False)
        pytest.skip(why, allow_module_level=True)
    interpreted = os.environ["TRITON_INTERPRET"] == "1"
    skip = pytest.mark.skipif(not interpreted and not torch.cuda.is_available(),
                              reason="Triton kernels need a CUDA device or TRITON_INTERPRET=1")
    return ("cuda" if torch.cuda.is_available() and not interpreted else "cpu"), skip


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root` (detrace-runs/ aside: detrace's own): a folder, a link and its target, or a file
    and the sha256 of its bytes. Equal before and after a command: it changed no byte, name or place there."""
    found: dict[str, str] = {}
    for top, folders, files in os.walk(root):
        folders[:] = [f for f in folders if f != "detrace-runs"]
        for name in folders + files:
            path = Path(top) / name
            relative = str(path.relative_to(root))
            if path.is_symlink():
                found[relative] = f"link to {os.readlink(path)}"
            elif path.is_dir():
                found[relative] = "folder"
            else:
                found[relative] = f"file {hashlib.sha256(path.read_bytes()).hexdigest()}"
    return found
