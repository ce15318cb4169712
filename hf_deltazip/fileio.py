"""Writing files so that an interruption never leaves a half-written one, with the user's permissions."""

from __future__ import annotations

import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Union

__all__ = ["atomic_write_bytes", "atomic_copy", "staged_writes"]


def atomic_write_bytes(path: Union[str, os.PathLike], chunks: Union[bytes, Iterable[bytes]]) -> None:
    """Write ``chunks`` to ``path`` through a temporary file in the same folder and a rename.

    An interruption leaves the previous file (if any) untouched and no partial file under ``path``.
    The new file gets the permissions of any file the user saves (``0o666`` less the umask), or keeps
    those of the file it replaces.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temporary(path)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in [chunks] if isinstance(chunks, (bytes, bytearray, memoryview)) else chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _sync_folder(path.parent)  # make the rename itself durable


def _sync_folder(folder: Path) -> None:
    try:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _create_temporary(path: Path) -> tuple[int, str]:
    """Open a new temporary file beside ``path``; return its descriptor and name.

    Unlike ``tempfile.mkstemp`` (always mode 0600), the file is created with mode 0666 so that the
    kernel applies the umask, as for any file the user saves; when ``path`` exists its permission
    bits are kept.
    """
    try:
        keep_mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        keep_mode = None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        if keep_mode is not None:
            try:
                os.chmod(tmp, keep_mode)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
        return fd, tmp
    raise FileExistsError(f"could not create a temporary file beside {path}: remove stale .{path.name}.*.tmp files")


def atomic_copy(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], chunk_bytes: int = 1 << 24) -> None:
    """Copy ``src`` to ``dst`` as :func:`atomic_write_bytes` writes (chunk by chunk, never a partial ``dst``)."""

    def chunks():
        with open(src, "rb") as f:
            while True:
                block = f.read(chunk_bytes)
                if not block:
                    return
                yield block

    atomic_write_bytes(dst, chunks())


class _Stage:
    """Files written under temporary names beside their destinations, renamed together by :func:`staged_writes`."""

    def __init__(self):
        self.pending: list = []  # (temporary, destination) in the order they will be renamed

    def path_for(self, path: Union[str, os.PathLike]) -> Path:
        """A temporary path beside ``path`` to write the new file to (with any writer, atomic or not);
        it becomes ``path`` when the stage commits."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temporary(path)
        os.close(fd)
        self.pending.append((Path(tmp), path))
        return Path(tmp)

    def write(self, path: Union[str, os.PathLike], chunks: Union[bytes, Iterable[bytes]]) -> None:
        atomic_write_bytes(self.path_for(path), chunks)

    def copy(self, src: Union[str, os.PathLike], dst: Union[str, os.PathLike]) -> None:
        atomic_copy(src, self.path_for(dst))


@contextmanager
def staged_writes():
    """Write several files that belong together (a delta's ``.dz`` and its config): every new file is
    written in full under a temporary name first, and only then are they renamed over the old ones, so an
    error while writing any of them (a full disk, an interrupted copy) leaves every earlier file as it was.

    Example:
        >>> with staged_writes() as stage:
        ...     stage.write(folder / "a.json", b"{}")
        ...     write_something(stage.path_for(folder / "b.bin"))
    """
    stage = _Stage()
    try:
        yield stage
    except BaseException:
        for tmp, _ in stage.pending:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    for tmp, path in stage.pending:
        os.replace(tmp, path)
    for folder in dict.fromkeys(path.parent for _, path in stage.pending):
        _sync_folder(folder)
