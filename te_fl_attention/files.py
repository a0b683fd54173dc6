"""Files from outside and files we write: never block on a FIFO or device, never leave half a file.

* :func:`open_regular` opens an input without blocking (``O_NONBLOCK``) and refuses anything that
  is not a regular file (a FIFO, a device such as ``/dev/zero``, a directory, a socket).
* :func:`check_output_path` checks, before any work, that an output can be created: its directory
  exists, is a directory and is writable, and the path itself is not a directory.
* :func:`atomic_output` writes to a temporary file in the target directory, flushes it to disk
  and renames it into place; on failure the temporary file is removed (no partial output).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
)  # fmt: skip


class NotRegularFile(OSError):
    """An input or store path that is a FIFO, device, directory or socket (never read)."""


class OutputPathError(OSError):
    """An output path that cannot be written (checked before the work starts)."""


class OutputExistsError(OutputPathError, FileExistsError):
    """The output must be a new file and one is there."""


def kind(mode: int) -> str:
    """``"a FIFO"``, ``"a character device"``... for an ``st_mode``."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open ``path`` for binary reading; :class:`NotRegularFile` unless it is a regular file.

    The open itself cannot block (``O_NONBLOCK``: a FIFO with no writer opens at once); the
    descriptor is switched back to blocking for the reads of the regular file.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{os.fspath(path)} is {kind(st.st_mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_output_path(path: str | os.PathLike[str], *, exist_ok: bool = True) -> Path:
    """``path`` as a :class:`Path` if an output can be written there; else
    :class:`OutputPathError` naming the path and the problem. Nothing is created."""
    out = Path(path)
    parent = out.parent
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        raise OutputPathError(f"cannot write {out}: directory {parent} does not exist") from None
    except OSError as exc:
        raise OutputPathError(f"cannot write {out}: {parent}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise OutputPathError(f"cannot write {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write {out}: directory {parent} is not writable")
    try:
        target = os.lstat(out)
    except FileNotFoundError:
        return out
    except OSError as exc:
        raise OutputPathError(f"cannot write {out}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(target.st_mode):
        raise OutputPathError(f"cannot write {out}: it is a directory")
    if not exist_ok:
        raise OutputExistsError(f"{out} already exists; give a new file name")
    return out


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], *, exist_ok: bool = True,
                  mode: int = 0o644) -> Iterator[Path]:  # fmt: skip
    """Yield a temporary path in ``path``'s directory; when the block succeeds, flush it to disk
    and move it to ``path`` (``exist_ok=False``: fail rather than replace an existing file).
    On any failure the temporary file is removed and ``path`` is untouched."""
    out = check_output_path(path, exist_ok=exist_ok)
    fd, name = tempfile.mkstemp(prefix=f".{out.name[:100]}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with contextlib.suppress(OSError):
            os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if exist_ok:
            os.replace(tmp, out)
        else:
            os.link(tmp, out)  # fails if it appeared meanwhile: never replaces a file
            os.unlink(tmp)
        _fsync_dir(out.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str) -> int:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_output`; returns the bytes
    written, read back from the file."""
    data = text.encode("utf-8")
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)
        if tmp.stat().st_size != len(data):
            raise OSError(f"short write to {tmp}")
    return len(data)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_private_dirs(directory: str | os.PathLike[str]) -> None:
    """Create ``directory`` and any missing parents as ``0700`` (whatever the umask); existing
    directories are left as they are."""
    missing = []
    d = Path(directory)
    while not d.exists():
        missing.append(d)
        if d.parent == d:
            break
        d = d.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
            os.chmod(d, 0o700)  # mkdir's mode is masked by the umask: chmod is not
