"""docs/production.md's commands, as the tests run them."""

import re
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "production.md"


def guide_commands(text: str) -> list[str]:
    """The commands of the guide's ```bash blocks: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if command and not command.startswith("#"):
                commands.append(" ".join(command.split()))
    return commands
