"""`detrace ablate --step S --run RUN -- CMD`: reproduce the loss spike at step S bit for bit, then change one thing
at a time to isolate its cause.

1. Baseline: CMD resumed from the last checkpoint C before S (the resume contract's DETRACE_RESUME_FROM) runs
   through S plus a few steps, traced at the metrics and semantic rungs. It must reproduce the original traced
   run RUN over steps C+1..S bit for bit (every record RUN has there), or nothing can be isolated: the verdict is
   then "not-reproducible" (exit 2). A baseline whose metric at S is under the spike threshold is "no-spike"
   (exit 0): nothing to isolate.
2. Variants, each resumed from a checkpoint and changing one thing (the data controls: docs/resume.md):
   - skip-batches: the batches of steps S-w..S are skipped (DETRACE_SKIP_STEPS; by default from C);
   - state-only: the batch of step S alone is skipped: the state at S is the baseline's, the data is other
     (resumed from the checkpoint after S steps when the run saved one, else from C);
   - data-from-earlier: resumed from the checkpoint C' before C, fed the batches steps C..S saw
     (DETRACE_DATA_SHIFT=C-C'): the batch of S arrives at step S-(C-C'), in another state;
   - user variants: NAME=--extra args (appended to CMD) or NAME=ENV:K=V[,K=V] (an environment change).
   A variant whose run fails is unavailable (its reason kept); the verdict is given from the others.
3. Per variant: the metric at (its) S against the baseline, whether it still spikes by the same threshold (the
   original run's median + k x MAD over the window before S), and where its trace first departs from the
   baseline's (`detrace.diff`: step, phase, module, op).
4. The summary: data (the spike needs the batches: skipping them removes it, and they spike in another state too),
   state (it survives other data, and the batches do not spike in another state), both (each removal removes
   it), setting (only a user variant removes it), or undetermined.
5. For a data or both verdict, the sample: the baseline's trace holds the dataset indices of S's batch (where the
   program's sampler is detrace's: the framework integrations); replays from C that drop half the candidates
   (DETRACE_DROP_SAMPLES) bisect them down to the one sample whose absence removes the spike, in about
   log2(batch) replays, the last one dropping that sample alone.
6. For a state verdict, the part: three replays from C with the baseline's data, each taking one part of the state
   from the checkpoint C' before C (DETRACE_RESTORE_PART: the learning rate, the optimizer's moments, the weights)
   and the rest from C. The verdict names the part(s) whose earlier version removes the spike, or says that none
   alone does.

The function that runs CMD is a parameter (`Launch`): the decision logic is tested on synthetic traces.

Modules: `config` (AblateConfig, the user's variants, the plan of runs), `driver` (the runs, one after the other:
baseline, variants, bisection, split), `evidence` (what the driver reads back from its runs, and the result that
ablate.json holds), `verdict` (the sentence the evidence points to).
"""

from __future__ import annotations

from detrace.investigate.ablate.config import BUILTINS, DEFAULT_AFTER, AblateConfig, Variant, parse_variant, plan
from detrace.investigate.ablate.driver import Launch, ablate, bisect, launcher, split
from detrace.investigate.ablate.evidence import (
    SCHEMA,
    AblateResult,
    Departure,
    Outcome,
    Samples,
    Split,
    batch_samples,
    reproduces,
)
from detrace.investigate.ablate.verdict import judge

__all__ = [
    "BUILTINS",
    "DEFAULT_AFTER",
    "SCHEMA",
    "AblateConfig",
    "AblateResult",
    "Departure",
    "Launch",
    "Outcome",
    "Samples",
    "Split",
    "Variant",
    "ablate",
    "batch_samples",
    "bisect",
    "judge",
    "launcher",
    "parse_variant",
    "plan",
    "reproduces",
    "split",
]
