"""The old name of `detrace.workload`, kept for one release: `python -m detrace.examples.train` still runs the
reference trainer (`detrace.workload.train`). New code uses `detrace.workload`."""
