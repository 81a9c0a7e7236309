"""`detrace validate [--fast | --only NAMES] [--steps N] [--at K] [--out DIR] [--timeout S] [--list]`:
the validation matrix of the reference workload (see `detrace.examples.validate`)."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from detrace.examples.validate import main as validate

    return validate(argv)
