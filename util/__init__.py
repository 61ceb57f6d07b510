"""Small rules every package needs, in one place (imports nothing of ours; any package may import it):
writing a file so that a reader never sees half of it, and whether a process is alive."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replaced_from_temp(path: str | os.PathLike, suffix: str = ".partial") -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without an error the temporary
    file replaces `path` in one rename (os.replace: atomic on POSIX), otherwise it is removed and
    `path` is left as it was. For writers that want a path (a library's save(), a stream)."""
    path = Path(path)
    tmp = path.with_name(path.name + suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write(path: str | os.PathLike, data: str | bytes, *, fsync: bool = False,
                 suffix: str = ".partial") -> None:
    """Write `data` (text or bytes) to `path` through a temporary file and one rename, so a reader
    or a crash sees the old file or the new one, never a torn one. `fsync` also forces the bytes
    to disk before the rename (progress records that a resume trusts). A unique `suffix` keeps
    concurrent writers of the same path apart."""
    with replaced_from_temp(path, suffix) as tmp:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (one we may not signal counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["atomic_write", "pid_alive", "replaced_from_temp"]
