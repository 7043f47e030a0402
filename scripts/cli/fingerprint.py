"""What a target computes, as one content hash (drafters/target/fingerprint.py): print it, or with --write hash
every file once and write the sidecar that later runs trust (`target.fingerprint: sidecar`).

    dflash-pipeline fingerprint TARGET [--write]
"""

from __future__ import annotations

from pathlib import Path

from drafters.target.fingerprint import SIDECAR, target_fingerprint, write_sidecar
from scripts.cli.refusal import refuse


def add_arguments(parser) -> None:
    parser.add_argument("target", type=Path)
    parser.add_argument("--write", action="store_true", help=f"hash every file and write {SIDECAR} beside them")


def run(args) -> int:
    if not (args.target / "config.json").is_file():
        return refuse(f"{args.target} is not a model folder (no config.json)")
    if args.write:
        print(f"wrote {write_sidecar(args.target)}")
    print(target_fingerprint(args.target, "sidecar" if args.write else "content"))
    return 0
