"""Writing files without following links: the one home of how nanotune creates and replaces files.

A run folder, a cache or an output path may hold a symbolic link planted by someone else (a shared
disk, a copied run folder). Opening `out/metrics.jsonl` for appending, or `out/x.tmp` for writing,
would then write through the link into whatever file it names. Every file nanotune writes goes
through these functions instead:

    with atomic_file(path) as f: f.write(...)   # a new temp file beside `path`, renamed over it at the end
    fd = open_regular(path, os.O_RDWR | os.O_CREAT)  # an existing file, appended to or locked in place
    with open_read(path) as f: ...              # a file someone else may have planted, read as bytes

`atomic_file` creates its temp file with O_EXCL (so nothing already there is opened, link or not) in
`path`'s own folder, and `os.replace` renames it over `path`: a link at `path` is replaced, never
followed. `open_regular` opens with O_NOFOLLOW and refuses anything but a regular file. O_NOFOLLOW
covers the last component only: the folders above (a `--out-dir` or `checkpoints/` that the user
made a link to another disk) are followed, as the user asked.
"""
import errno
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager


class UnsafePath(ValueError):
    """A path that nanotune will not write through: a symbolic link, or not a regular file."""


def _refuse(path, what):
    return UnsafePath(f"{path!r} is {what}; nanotune does not write through links or into special files. "
                      "Remove it (or choose another folder) and run again")


def open_regular(path, flags, mode=0o644):
    """os.open(path, flags) for a regular file only: a symbolic link at `path` or a non-regular file (a FIFO,
    a device) raises UnsafePath. Returns the descriptor."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0), mode)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.ENXIO and os.path.islink(path)):
            raise _refuse(path, "a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refuse(path, "not a regular file")
    os.set_blocking(fd, True)
    return fd


def open_read(path):
    """`path` opened for reading bytes, when it is a regular file: a link or a special file (a FIFO, which
    would block) raises UnsafePath, so a planted link cannot make nanotune read another file."""
    return os.fdopen(open_regular(path, os.O_RDONLY), "rb")


def open_append(path):
    """`path` opened for appending text (created if missing), never through a link."""
    return os.fdopen(open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


def check_writable_file(path):
    """Refuse now, before any long work, a `path` that a later write would have to go through: a link or a
    special file. A missing path or a regular file passes."""
    if os.path.islink(path):
        raise _refuse(path, "a symbolic link")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise _refuse(path, "not a regular file")


@contextmanager
def atomic_file(path, mode="w"):
    """A file object to write `path`'s new content into. It is a temp file created exclusively in `path`'s
    folder; when the block succeeds it is flushed, synced and renamed over `path` (atomic: a reader sees the
    old file or the new one), and when it fails it is removed."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def remove_tree(path):
    """Delete `path`: a folder with everything in it (links inside are removed, not followed), or a link or file."""
    if os.path.islink(path) or not os.path.isdir(path):
        if os.path.lexists(path):
            os.unlink(path)
    else:
        shutil.rmtree(path)
