"""The verdict of `detrace ablate`: what the variants' evidence points to (data, state, both, a setting, or
undetermined), in one sentence."""

from __future__ import annotations

from collections.abc import Sequence

from detrace.investigate.ablate.config import BUILTINS, AblateConfig
from detrace.investigate.ablate.evidence import Outcome
from detrace.verdicts import AblateCause


def judge(config: AblateConfig, c: int, outcomes: Sequence[Outcome], sample: str | None = None
          ) -> tuple[AblateCause, str]:
    """What the variants' evidence points to, in one sentence (then the bisection's `sample` clause or the split's,
    what could not run, and a user variant that changed nothing)."""
    ran = [o for o in outcomes if o.unavailable is None]
    if outcomes and not ran:
        return "undetermined", (f"undetermined: no variant could run from the checkpoint after {c} steps "
                                f"({', '.join(o.variant.name for o in outcomes)}: ablate.json says why), so nothing "
                                "tells the spike's cause apart")
    cause, summary = _cause(config, c, ran)
    if sample is not None:
        summary += f"; {sample}"
    same = [o.variant.name for o in outcomes if o.variant.name not in BUILTINS and o.unavailable is None
            and o.departure is None and o.variant.start >= c]
    if same:
        summary += (f"; {', '.join(same)} computed the baseline's very bits: nothing it changes reaches the "
                    f"computation after the checkpoint (a setting the checkpoint after {c} steps already holds, "
                    "restored with the optimizer's or scheduler's state, or one read only at the start), so it "
                    "cannot remove the spike from there")
    unavailable = [o.variant.name for o in outcomes if o.unavailable is not None]
    if unavailable:
        summary += (f"; {', '.join(unavailable)} could not run (ablate.json says why), the verdict comes from the "
                    "others")
    return cause, summary


def _cause(config: AblateConfig, c: int, outcomes: Sequence[Outcome]) -> tuple[AblateCause, str]:
    by_name = {o.variant.name: o for o in outcomes}
    skip, earlier, only = (by_name.get(name) for name in ("skip-batches", "data-from-earlier", "state-only"))
    removed_by_users = [o.variant.name for o in outcomes
                        if o.variant.name not in BUILTINS and o.value is not None and not o.spiked]
    s = config.step
    data_matters = skip is not None and skip.value is not None and not skip.spiked
    state_matters = earlier is not None and earlier.value is not None and not earlier.spiked
    skipped = skip.variant.env["DETRACE_SKIP_STEPS"] if skip is not None else ""
    from_state = f"from the state at step {earlier.variant.start}" if earlier is not None else ""
    also = ""
    if removed_by_users:
        also = f"; {', '.join(removed_by_users)} also remove{'s' * (len(removed_by_users) == 1)} it"
    if data_matters and state_matters:
        return "both", (f"both: skipping the batches of steps {skipped} removes the spike, and the same batches "
                        f"{from_state} do not spike: it needs that data and that state together{also}")
    if data_matters:
        alone = ("" if only is None else f"; with the batch of step {s} replaced, the same state does not spike"
                 if not only.spiked else "")
        tail = f"; the same batches {from_state} also spike" if earlier is not None else ""
        return "data", f"data: skipping the batches of steps {skipped} removes the spike{tail}{alone}{also}"
    if state_matters:
        return "state", (f"state: the spike survives without the batches of steps {skipped}, and the same batches "
                         f"{from_state} do not spike{also}")
    if removed_by_users:
        return "setting", (f"setting: no change of data or state removes the spike at step {s}, but "
                           f"{', '.join(removed_by_users)} do{'es' * (len(removed_by_users) == 1)}")
    return "undetermined", f"undetermined: the spike at step {s} survives every variant (checkpoint {c})"

