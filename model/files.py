"""Writing files and folders whole or not at all, never through a link: the one home of how nanotune writes.

A run folder, a cache or an output path may hold a symbolic link planted by someone else (a shared disk, a
copied run folder). Opening `out/metrics.jsonl` for appending, or `out/x.tmp` for writing, would then write
through the link into whatever file it names. Every file nanotune writes goes through these functions:

    with atomic_file(path) as f: f.write(...)   # new content for `path`, replacing it whole at the end
    with atomic_path("out.gguf") as tmp: ...    # the same, for a writer that takes a path
    with atomic_dir("out/adapter") as tmp: ...  # the same, for a folder
    fd = open_regular(path, os.O_RDWR | os.O_CREAT)  # a file appended to or locked in place
    with open_read(path) as f: ...              # a file someone else may have planted, read as bytes

New content is written under a temporary name inside a private folder (`tempfile.mkdtemp`: created
exclusively, mode 0700) in the target's own folder, so nobody can swap it for a link and the rename stays on
one file system; `os.replace` then puts it in place, replacing a link at the target itself, never the link's
target. `open_regular` opens with O_NOFOLLOW and refuses anything but a regular file. O_NOFOLLOW covers the
last component only: the folders above (a `--out-dir` or `checkpoints/` that the user made a link to another
disk) are followed, as the user asked. `atomic_path`, `atomic_dir` and `check_new_output` turn the write
errors users meet (disk full, a read-only folder, a file-size limit) into one ValueError line.
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
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
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


def remove_tree(path):
    """Delete `path`: a folder with everything in it (links inside are removed, not followed), or a link or file."""
    if os.path.islink(path) or not os.path.isdir(path):
        if os.path.lexists(path):
            os.unlink(path)
    else:
        shutil.rmtree(path)


# ----------------------------------------------------------------------------- whole or not at all


@contextmanager
def _private_folder(target):
    """A new folder beside `target`, only this process's, removed with what is left in it at the end."""
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=os.path.dirname(os.path.abspath(target)))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _replacing(path):
    """The path of a new empty regular file that replaces `path` when the block succeeds (OSErrors as raised)."""
    with _private_folder(path) as folder:
        tmp = os.path.join(folder, os.path.basename(path))
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        yield tmp
        os.replace(tmp, path)


@contextmanager
def atomic_file(path, mode="w"):
    """A file object for `path`'s new content: flushed, synced and put in place when the block succeeds (a
    reader sees the old file or the new one), removed when it fails. Errors are the OSErrors raised."""
    with _replacing(path) as tmp, open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def atomic_path(path):
    """The path of a new empty regular file to write `path`'s content into; on success it replaces `path`,
    on failure it is removed and `path` is left as it was. A write error users can fix is one ValueError."""
    try:
        with _replacing(path) as tmp:
            yield tmp
    except OSError as e:
        raise write_error(e, path) or e from None


@contextmanager
def atomic_dir(folder):
    """A new empty folder to write `folder`'s content into; on success it takes `folder`'s place (a previous
    `folder` is removed, a link at `folder` is replaced, not followed), on failure it is removed."""
    folder = os.path.abspath(folder)
    try:
        with _private_folder(folder) as private:
            tmp, old = os.path.join(private, "new"), os.path.join(private, "old")
            os.mkdir(tmp)
            yield tmp
            if os.path.lexists(folder):
                os.replace(folder, old)  # removed with `private`
            os.replace(tmp, folder)
    except OSError as e:
        raise write_error(e, folder) or e from None


# ----------------------------------------------------------------------------- errors users can fix

# errno -> what the user can do about it.
WRITE_ERRORS = {
    errno.ENOSPC: "the disk is full: free some space or choose another location",
    errno.EDQUOT: "the disk quota is used up: free some space or choose another location",
    errno.EROFS: "the file system is read-only: choose another location",
    errno.EACCES: "permission denied: choose a folder you can write to",
    errno.EPERM: "permission denied: choose a folder you can write to",
    errno.EFBIG: "the file is larger than this system's file-size limit (ulimit -f): raise it or choose a smaller "
                 "--ftype / --dtype",
}


def write_error(e: OSError, path) -> ValueError | None:
    """The one-line error for a failed write of `path`, or None when `e` is not a write failure users can fix."""
    if e.errno is None and "requested and" in str(e):  # numpy's tofile: a short write, with no errno
        return ValueError(f"cannot write {path}: the write stopped short ({e}); the disk is full or the file is "
                          "over this system's file-size limit (ulimit -f): free some space or choose another "
                          "location")
    if e.errno not in WRITE_ERRORS:
        return None
    return ValueError(f"cannot write {path}: {WRITE_ERRORS[e.errno]} ({os.strerror(e.errno)})")


def check_new_output(out, overwrite, inputs=(), option="--out"):
    """Refuse an output path that exists (unless `overwrite`), is a folder, or is one of `inputs`
    (the same file under any name, even with `overwrite`)."""
    for src in inputs:
        if src is not None and os.path.exists(src) and os.path.exists(out) and os.path.samefile(src, out):
            raise ValueError(f"{option} {out!r} is the input {src!r}; write to another file")
    if os.path.isdir(out):
        raise ValueError(f"{option} {out!r} is a folder; name the file to write")
    if os.path.lexists(out) and not overwrite:
        raise ValueError(f"{option} {out!r} exists; pass --overwrite to replace it, or choose another name")
    check_writable_parent(out, option)


def check_writable_parent(out, option="--out"):
    """Refuse, before any work, an output whose folder is missing or cannot be written."""
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ValueError(f"{option} {out!r}: the folder {parent!r} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{option} {out!r}: the folder {parent!r} cannot be written (read-only or not yours); "
                         "choose another location")
