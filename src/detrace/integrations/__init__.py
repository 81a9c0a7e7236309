"""Framework integrations: one callback each, translating the framework's events into `TrainState`,
global steps and metrics (the logic itself lives in the core once).

- `detrace.integrations.hf.DetraceCallback`: transformers' `Trainer`.
- `detrace.integrations.lightning.DetraceCallback`: Lightning's `Trainer` (`lightning` or `pytorch_lightning`).

Loops written with accelerate directly need no integration: see docs/integrations.md.
"""
