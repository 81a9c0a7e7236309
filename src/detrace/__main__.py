"""`python -m detrace` is the same as the `detrace` command."""

from detrace.cli import run

run()
