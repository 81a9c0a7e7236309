"""`detrace verify-checkpoint PATH`: check a checkpoint against its fingerprint manifest.

PATH is a checkpoint root (DETRACE_CKPT_DIR, whose `latest` names the current version) or one version
directory. Exit 0 when every stored tensor and file matches, 1 when the checkpoint is not what its manifest says
(a tensor or file that differs, is missing, short, or not a regular file, named), 2 when there is no verdict: no
readable checkpoint at PATH, a file the system will not read, or a checkpoint that changed while it was verified.
"""

from __future__ import annotations

from detrace.cli._args import ArgumentParser
from detrace.state import verify_checkpoint


def main(argv: list[str]) -> int:
    parser = ArgumentParser("verify-checkpoint", description="Check a checkpoint against its fingerprint manifest.")
    parser.add_argument("path", metavar="PATH", help="checkpoint directory (a root with 'latest', or one version)")
    args = parser.parse_args(argv)
    manifest = verify_checkpoint(args.path)
    chunks = sum(len(entries) for entries in manifest.tensors.values())
    print(
        f"ok: {args.path} (step {manifest.step}, {len(manifest.tensors)} tensors in {chunks} chunks, "
        f"{len(manifest.files)} files, world size {manifest.world_size}) matches its manifest"
    )
    return 0
