"""The test tiers (tests/support/_tiers.py): the README's quick command runs the unit and integration tiers and one
real test per command and framework integration; CI runs it and then the rest, so the whole suite once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from _tiers import CHOSEN, COMMANDS, INTEGRATIONS, is_quick, run_order

from detrace.cli import COMMANDS as CLI_COMMANDS

ROOT = Path(__file__).parents[2]


def test_every_command_and_framework_integration_has_its_quick_test() -> None:
    assert sorted(COMMANDS) == sorted(CLI_COMMANDS)
    # the framework integrations are the modules the package's docstring lists as `detrace.integrations.NAME.`
    import detrace.integrations

    listed = re.findall(r"`detrace\.integrations\.(\w+)\.", detrace.integrations.__doc__ or "")
    assert sorted(INTEGRATIONS) == sorted(set(listed)) == ["accelerate", "hf", "lightning"]


@pytest.mark.parametrize("nodeid", sorted(CHOSEN))
def test_each_chosen_test_exists_and_is_no_racing_test(nodeid: str) -> None:
    # A renamed or deleted test would silently leave its command out of the quick tier; a racing one would hold the
    # machine alone in the middle of it.
    path, _, name = nodeid.partition("::")
    tree = ast.parse((ROOT / path).read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert name in functions, f"{nodeid} is no test function"
    marks = [ast.unparse(decorator) for decorator in functions[name].decorator_list]
    module_marks = [ast.unparse(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets)]
    assert not any("race" in mark for mark in [*marks, *module_marks]), nodeid
    # An e2e file's other tests run in the rest of the suite: a module-scoped fixture the chosen one used (real runs)
    # would be made in both pytest runs.
    shared = {name for name, node in functions.items() for decorator in node.decorator_list
              if isinstance(decorator, ast.Call) and any(keyword.arg == "scope" and ast.literal_eval(keyword.value)
                                                         == "module" for keyword in decorator.keywords)}
    used = {arg.arg for arg in functions[name].args.args}
    assert not (path.startswith("tests/e2e/") and used & shared), f"{nodeid} uses the module fixtures {used & shared}"


@pytest.mark.parametrize(("nodeid", "markers", "quick"), [
    ("tests/unit/test_x.py::test_a", [], True),
    ("tests/integration/test_x.py::test_a[1-2]", ["parametrize"], True),
    ("tests/integration/test_x.py::test_a", ["slow"], False),
    ("tests/integration/test_x.py::test_a", ["race"], False),
    ("tests/e2e/test_x.py::test_a", [], False),  # the e2e tier is real processes: only the chosen ones
    ("tests/e2e/test_run.py::test_a_program_that_imports_detrace_before_torch_is_traced", ["slow"], True),
    ("tests/integration/test_ablate_trainer.py::test_each_planted_spike_is_found_reproduced_and_told_apart[data]",
     ["parametrize"], True),
])
def test_the_quick_tier(nodeid: str, markers: list[str], quick: bool) -> None:
    assert is_quick(nodeid, markers) is quick


def test_a_run_takes_the_racing_then_the_real_process_tests_and_ends_with_in_process_ones() -> None:
    # `-m "not quick"` holds the e2e tier's in-process tests and real-process unit tests (ranks spawned, tens of
    # seconds): those must not start last, where one worker holds the run while the other idles
    tests = {
        "in-process e2e": (("tests", "e2e", "test_x.py"), []),
        "spawned unit": (("tests", "unit", "test_x.py"), ["slow"]),
        "in-process unit": (("tests", "unit", "test_x.py"), []),
        "torchrun e2e": (("tests", "e2e", "test_x.py"), ["slow"]),
        "racing integration": (("tests", "integration", "test_x.py"), ["race"]),
        "slow integration": (("tests", "integration", "test_x.py"), ["parametrize", "slow"]),
        "racing e2e": (("tests", "e2e", "test_x.py"), ["slow", "race"]),
    }
    assert sorted(tests, key=lambda name: run_order(*tests[name])) == [
        "racing e2e", "racing integration", "torchrun e2e", "slow integration", "spawned unit", "in-process e2e",
        "in-process unit"]


def _readme_test_commands() -> list[str]:
    section = (ROOT / "README.md").read_text().split("\n## Test\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_gives_the_quick_command_and_the_full_suite() -> None:
    assert _readme_test_commands() == ["python -m pytest -q -m quick", "python -m pytest -q"]


def test_ci_runs_the_readmes_quick_command_and_then_the_rest_of_the_suite() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    runs = [line.strip() for line in ci.splitlines() if re.match(r"\s*python -m pytest ", line)]
    quick, rest = _readme_test_commands()[0], 'python -m pytest -q -m "not quick"'
    assert [run.startswith(quick + " ") or run == quick for run in runs] == [True, False], runs
    assert runs[1].startswith(rest + " ") or runs[1] == rest, runs
