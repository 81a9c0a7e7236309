"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _ranks import free_port as _free_port


@pytest.fixture(name="free_port")
def free_port_fixture() -> Callable[[], int]:
    """A function giving a TCP port that was free on 127.0.0.1 a moment ago: call it once per rendezvous."""
    return _free_port
