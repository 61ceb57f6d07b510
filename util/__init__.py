"""Small rules every package needs, in one place (imports nothing of ours; any package may import it):
writing a file (or replacing a directory) so that a reader never sees half of it, and whether a process is
alive."""
from __future__ import annotations

import contextlib
import os
import shutil
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


def replace_dir(src: str | os.PathLike, dest: str | os.PathLike, aside: str | os.PathLike | None = None) -> None:
    """Put the finished directory `src` at `dest`, replacing what is there, so that at every moment one
    of the two complete directories exists: an existing `dest` is first renamed to `aside` (default
    `.<name>.old` beside it), `src` renamed to `dest`, then `aside` deleted. A crash leaves either the
    old directory at `dest` or the new one, and at worst a stale `aside` to delete. The caller decides
    whether `dest` may be replaced (it must be ours); this only moves directories on one file system."""
    src, dest = Path(src), Path(dest)
    old = Path(aside) if aside is not None else dest.with_name(f".{dest.name}.old")
    moved = False
    if dest.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
        moved = True
    try:
        os.replace(src, dest)
    except BaseException:
        if moved and not dest.exists():
            os.replace(old, dest)  # put the old one back
        raise
    if moved:
        shutil.rmtree(old, ignore_errors=True)


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


__all__ = ["atomic_write", "pid_alive", "replace_dir", "replaced_from_temp"]
