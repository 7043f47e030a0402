"""This pipeline's own command line as a child process: the same interpreter, `-m scripts.cli VERB ...`
(`dflash-pipeline VERB ...` where the package is installed)."""

import sys


def cli_command(verb: str, *args) -> list[str]:
    return [sys.executable, "-m", "scripts.cli", verb, *map(str, args)]
