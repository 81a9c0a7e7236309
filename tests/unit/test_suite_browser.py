"""The README's test command on a fresh machine: a test that needs the headless browser is skipped where it is
missing, saying how to install it, and fails in CI, which installs it (issue 36: a fresh clone's suite failed)."""

from __future__ import annotations

import pytest
from _tools import INSTALL_CHROMIUM, missing_browser


def test_there_is_nothing_to_say_where_the_browser_is() -> None:
    assert missing_browser("/usr/bin/chromium", {"CI": "true"}) is None


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_a_machine_without_the_browser_skips_with_the_command_that_installs_it(ci: str | None) -> None:
    fail, why = missing_browser(None, {} if ci is None else {"CI": ci}) or (None, "")
    assert fail is False and "Debian's chromium" in why and INSTALL_CHROMIUM in why


@pytest.mark.parametrize("ci", ["true", "1", "True"])
def test_ci_without_the_browser_fails(ci: str) -> None:
    fail, why = missing_browser(None, {"CI": ci}) or (None, "")
    assert fail is True and why.endswith("CI requires it")
