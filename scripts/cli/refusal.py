"""How a verb refuses: one line on stderr that names what to change, no traceback, the verb's exit status."""

import sys


def refuse(err: BaseException | str, code: int = 2, note: str = "") -> int:
    print(f"error: {err}{note}", file=sys.stderr)
    return code
