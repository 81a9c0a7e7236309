"""Framework integrations: one callback each, translating the framework's events into `TrainState`,
global steps and metrics (the logic itself lives in the core once).

- `detrace.integrations.hf.DetraceCallback`: transformers' `Trainer`.
- `detrace.integrations.lightning.DetraceCallback`: Lightning's `Trainer` (`lightning` or `pytorch_lightning`).
- `detrace.integrations.accelerate.register(accelerator)`: a loop's `accelerator.save_state` / `load_state`.
- `detrace.integrations.advice`: which of these fits a script, for messages about scripts that follow none.
"""
