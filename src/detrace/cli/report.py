"""`detrace report RUN_OR_LOCATE_DIR [-o FILE]`: write one self-contained HTML file (no network needed)."""

from __future__ import annotations

from detrace.cli._args import ArgumentParser
from detrace.report.html import write_report


def main(argv: list[str]) -> int:
    parser = ArgumentParser("report", "Write a self-contained HTML report (inline CSS and SVG, no network) of a run "
                            "directory or of a 'detrace locate' directory.")
    parser.add_argument("path", metavar="RUN_OR_LOCATE_DIR", help="a run directory or a locate --out directory")
    parser.add_argument("-o", "--output", metavar="FILE", default=None,
                        help="where to write the HTML (default: DIR/report.html)")
    args = parser.parse_args(argv)
    print(write_report(args.path, args.output))
    return 0
