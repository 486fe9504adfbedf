"""Filesystem helpers without heavy imports (the data pipeline uses them before torch is loaded)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(staging: Path, target: Path) -> None:
    """Move a fully written `staging` folder to `target`; an old `target` is removed only once the new one is in place.

    Both renames are atomic on one filesystem, so a crash leaves either the old or the new folder
    (plus, at worst, a hidden `.<name>.old-<pid>` leftover), never a half-written one.
    """
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
