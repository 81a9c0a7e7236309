"""Every command's verdicts and the exit code each maps to: the one place that maps them.

What the codes mean (errors.py): 0 "yes" (identical, deterministic, exact), 1 "no" (diverged, nondeterministic,
a real effect), 2 "no answer" (bad input, incomparable, inconclusive). check-resume says more than yes or no, so
it uses 3 and 4 too. Errors (`detrace.errors.DetraceError`) carry their own code.
"""

from __future__ import annotations

from typing import Final, Literal

DiffVerdict = Literal["identical", "diverged", "incomparable"]
"""`detrace diff` and `detrace check`: two runs' traces."""
LocateVerdict = Literal["deterministic", "nondeterministic", "inconclusive"]
"""`detrace locate`: the ladder."""
ResumeVerdict = Literal["exact", "resume-changed-the-run", "nondeterministic", "inconclusive"]
"""`detrace check-resume`: whether stopping and resuming reproduces the uninterrupted run."""
NoiseVerdict = Literal["identical", "noise", "real"]
"""`detrace compare`: a candidate run against two baselines."""
RecheckVerdict = Literal["clean", "transient", "persistent", "inexact-resume", "software-nondeterminism"]
"""`detrace recheck`: a step re-executed on the same devices and on others (a fault follows the device); an
inexact resume leaves no answer about the devices (2)."""
CertifyVerdict = Literal["certified", "violations"]
"""`detrace certify`: every invariant of one trace holds, or some are violated (listed)."""
ReplayVerdict = Literal["deterministic", "nondeterministic"]
"""`detrace replay`: one captured op call executed many times."""
DoctorVerdict = Literal["ok", "settings-off"]
"""`detrace doctor`: this environment's determinism settings."""
TopologyVerdict = Literal["identical", "diverged"]
"""`detrace check-topology`: the same bits at every world size, or not."""
ValidateVerdict = Literal["green", "failures"]
"""`detrace validate`: every cell of the validation matrix passed, or some failed."""
SpikesVerdict = Literal["clean", "spikes"]
"""`detrace spikes`: no step of the metric jumps above its trailing threshold, or some do (listed)."""
AblateVerdict = Literal["no-spike", "isolated", "not-reproducible"]
"""`detrace ablate`: the baseline replay does not spike at S (nothing to isolate), the variants gave a verdict,
or the replay does not reproduce the original run's records (nothing can be isolated on it)."""
AblateCause = Literal["data", "state", "both", "setting", "undetermined"]
"""`detrace ablate`'s summary: what the variants' evidence points to as the spike's cause."""
AuditVerdict = Literal["clean", "hazards"]
"""`detrace audit`: no certain determinism hazard in the run, or some (possible ones alone leave it clean)."""

DIFF: Final[dict[DiffVerdict, int]] = {"identical": 0, "diverged": 1, "incomparable": 2}
LOCATE: Final[dict[LocateVerdict, int]] = {"deterministic": 0, "nondeterministic": 1, "inconclusive": 2}
RESUME: Final[dict[ResumeVerdict, int]] = {"exact": 0, "resume-changed-the-run": 1, "nondeterministic": 3,
                                           "inconclusive": 4}
NOISE: Final[dict[NoiseVerdict, int]] = {"identical": 0, "noise": 0, "real": 1}
RECHECK: Final[dict[RecheckVerdict, int]] = {"clean": 0, "transient": 1, "persistent": 1, "inexact-resume": 2,
                                             "software-nondeterminism": 1}
CERTIFY: Final[dict[CertifyVerdict, int]] = {"certified": 0, "violations": 1}
REPLAY: Final[dict[ReplayVerdict, int]] = {"deterministic": 0, "nondeterministic": 1}
DOCTOR: Final[dict[DoctorVerdict, int]] = {"ok": 0, "settings-off": 1}
TOPOLOGY: Final[dict[TopologyVerdict, int]] = {"identical": 0, "diverged": 1}
VALIDATE: Final[dict[ValidateVerdict, int]] = {"green": 0, "failures": 1}
SPIKES: Final[dict[SpikesVerdict, int]] = {"clean": 0, "spikes": 1}
ABLATE: Final[dict[AblateVerdict, int]] = {"no-spike": 0, "isolated": 1, "not-reproducible": 2}
AUDIT: Final[dict[AuditVerdict, int]] = {"clean": 0, "hazards": 1}
