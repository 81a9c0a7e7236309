"""The test tiers: which tests the README's quick command (`python -m pytest -q -m quick`) runs, and in which order a
run takes its tests (run_order).

The quick tier is the unit and integration tiers, but for their tests marked `slow` (real multi-process jobs) or
`race` (they want the machine to themselves), and, on top, one test per command and per framework integration
that runs it for real, chosen below. Everything else (every torchrun job, every framework's end-to-end test, the
racing tests) is the rest of the full suite, `-m "not quick"`: the two selections are complements, so CI, which
runs the quick command and then the rest, runs the whole suite once. A test added with `slow` or `race`, or in
tests/e2e, stays out of the quick tier unless this table names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

QUICK_TIERS = ("tests/unit/", "tests/integration/")
"""The tiers whose tests are quick unless marked `slow` or `race`."""

COMMANDS: dict[str, str] = {
    "run": "tests/e2e/test_run.py::test_a_program_that_imports_detrace_before_torch_is_traced",
    "diff": "tests/e2e/test_run_lost_data.py::test_diff_of_traces_that_end_inside_a_step_says_so",
    "locate": "tests/e2e/test_run_lost_data.py::test_locate_does_not_call_a_torn_trace_deterministic_without_saying_so",
    "check": "tests/e2e/test_check_e2e.py::test_a_deterministic_script_is_identical_in_two_runs",
    "check-resume": "tests/e2e/test_integrations_accelerate.py::test_check_resume_proves_the_registered_loop_exact",
    "check-topology": "tests/e2e/test_topology.py::test_check_topology_finds_a_plain_loops_naive_reduction",
    "replay": "tests/integration/test_replay.py::test_deterministic_op_reports_no_fix",
    "report": "tests/integration/test_report.py::test_run_report_in_a_real_browser",
    "compare": "tests/integration/test_compare_cli.py::test_any_change_is_real_against_identical_baselines",
    "verify-checkpoint": "tests/integration/test_checkpoint.py::test_verify_checkpoint_command_in_a_real_process",
    "doctor": "tests/integration/test_doctor.py::test_doctor_names_what_is_off_and_exits_1",
    "audit": "tests/integration/test_audit.py::test_the_reference_trainers_moe_backward_index_put_is_certain",
    "certify": "tests/integration/test_global_steps.py::test_certify_expects_a_resumed_run_from_its_first_global_step",
    "fingerprint": "tests/unit/test_digest_cli.py::test_torch_file",
    # The matrix itself (`detrace validate --fast`: minutes of racing runs) is the full suite's
    # test_the_ci_subset_is_green; this one runs a verification command in a process of its own, as validate does.
    "validate": "tests/e2e/test_validate.py::test_a_failed_command_is_explained_by_the_cause_it_quotes",
    "spikes": "tests/integration/test_ablate_trainer.py::test_each_planted_spike_is_found_reproduced_and_told_apart",
    "ablate": "tests/integration/test_ablate_trainer.py::test_each_planted_spike_is_found_reproduced_and_told_apart",
    "recheck": "tests/integration/test_defects.py::test_recheck_command_prints_the_verdict_and_exits_with_its_code",
}
"""For each command, one test that runs it on a real training program (a test function: all its parameters)."""

INTEGRATIONS: dict[str, str] = {
    # not a test of the file's module fixture (a traced run and a resumed one, 2 HF processes), which the rest of the
    # suite would make again
    "hf": "tests/e2e/test_integrations_hf.py::test_a_masked_lm_collator_resumes_exactly_with_0_and_2_workers",
    "lightning": "tests/integration/test_lightning.py::"
                 "test_resume_from_any_periodic_checkpoint_is_exact_with_or_without_workers",
    "accelerate": "tests/e2e/test_integrations_accelerate.py::test_check_resume_proves_the_registered_loop_exact",
}
"""For each framework integration (detrace.integrations' modules), one test that resumes its trainer for real."""

CHOSEN = frozenset(COMMANDS.values()) | frozenset(INTEGRATIONS.values())


def is_quick(nodeid: str, markers: Iterable[str]) -> bool:
    """Whether the test `nodeid` (as pytest names it from the project's root), marked `markers`, is in the quick
    tier."""
    function = nodeid.partition("[")[0]  # a parametrized test's every case
    marks = set(markers)
    return function in CHOSEN or (nodeid.startswith(QUICK_TIERS) and not marks & {"slow", "race"})


TIERS = ("e2e", "integration", "unit")
"""The tiers, the slowest first."""


def run_order(parts: Sequence[str], markers: Iterable[str]) -> tuple[bool, bool, int]:
    """Where a test in the folders `parts` (its path's), marked `markers`, runs in a pytest run (a sort key): the racing
    tests first (they hold the machine alone: one after the other, at once), then the real-process tests (`slow`),
    the slowest tier first, then the in-process ones. The last tests to start are short: a worker that takes a long
    one last holds the run that long while the other idles (a unit test that spawns ranks, tens of seconds, ran last
    of all when the tier alone decided)."""
    marks = set(markers)
    tier = next((i for i, name in enumerate(TIERS) if name in parts), len(TIERS))
    return "race" not in marks, "slow" not in marks, tier
