"""Files written whole or not at all, and read and written never through a symlink.

    write_atomic(path, fill)   fill(f) writes a new file beside `path`, which then replaces `path`
    open_regular(path)         `path` opened for reading ('rb') when it is a regular file, else OSError

A folder that others can write (a shared cache, a run folder on a shared disk) may hold a symlink
planted where a file is expected, so that writing it clobbers a file elsewhere, or reading it
leaks one. Neither function follows a symlink at `path`: the temp file is created with
O_CREAT | O_EXCL | O_NOFOLLOW under a random name (a file or symlink already there is an error,
never opened), and os.replace renames it over `path`, replacing a symlink there rather than
writing through it. The folders above `path` are the user's choice and may be symlinks.
"""
import contextlib
import errno
import os
import secrets
import stat


def write_atomic(path, fill):
    """Call fill(f) on a new binary file in `path`'s folder, then rename it to `path` (atomic: a reader sees
    the old file or the new one, never half of one). On any error the temp file is removed and the error
    raised; `path` is unchanged."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def open_regular(path):
    """`path` opened for reading in binary mode. A symlink (ELOOP), a folder, a FIFO or a device is an
    OSError saying so: nothing but a regular file is read, and opening a FIFO does not hang."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "a symbolic link, not followed", path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
