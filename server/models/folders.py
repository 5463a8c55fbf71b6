"""Where hicache keeps what it writes (`hicache_home`), and a folder written whole or not at
all: filled in a temporary sibling, then renamed into place.

rename is atomic, so a process that sees the folder sees it whole, and of two processes
writing it at once one wins (the other's copy is dropped). The folder gets the mode a plain
mkdir would (the umask's), not mkdtemp's 0700: other users of a shared $HICACHE_HOME read it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_HICACHE_HOME = "~/.cache/hicache"


def hicache_home() -> Path:
    """`$HICACHE_HOME`, else `~/.cache/hicache` (not created here)."""
    return Path(os.environ.get("HICACHE_HOME") or DEFAULT_HICACHE_HOME).expanduser()


def write_folder(final: Path, fill: Callable[[Path], None]) -> None:
    """`fill(tmp)` writes the folder's files into `tmp`, which then becomes `final`. OSError
    naming `final` when it cannot be written (a lost race is no error)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        fill(tmp)
        os.rename(tmp, final)
    except OSError as e:
        if not final.is_dir():  # not a lost race: a real failure
            raise OSError(f"cannot write {final}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename won
