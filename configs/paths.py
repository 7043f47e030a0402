"""Where the pipeline keeps what it prepares once per machine (targets, regenerated data, feature caches)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Cache root: $DFLASH_CACHE, else ~/.cache/dflash-pipeline."""
    return Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash-pipeline"))
