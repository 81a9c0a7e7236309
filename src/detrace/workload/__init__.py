"""The reference workload: a hybrid SSM/attention/MoE model (`model`), its synthetic data (`data`), its
trainer under every parallelism (`train`, `parallel`) and the validation matrix (`validate`).

See docs/workload.md.
"""
