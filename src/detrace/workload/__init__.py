"""The reference workload: a hybrid SSM/attention/MoE model (`model`), its synthetic data (`data`), its
trainer under every parallelism (`train`, `parallel`) and the validation matrix (`validate`).

See docs/workload.md.
"""

RACING_THREADS = 8
"""The threads the reference workload runs where its nondeterminism must show (`detrace locate`'s embedded default,
`detrace validate`'s single-process rows): more than a small machine's cores, so that the operating system
interleaves them and the index dispatch's race strikes even where other work keeps the cores busy (there, at 2
threads, two 3-step runs agreed bit for bit 2 times in 3; at 8, 0 times in 3)."""
