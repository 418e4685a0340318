"""Writing output files and folders whole or not at all, without following links planted beside them.

    with atomic_path("out.gguf") as tmp:      # write tmp (a new, empty regular file) however you like
        writer(tmp)
    # out.gguf is now the complete file, or (on any error) untouched

Each write goes to a temporary name inside a private folder (`tempfile.mkdtemp`: created with
O_EXCL semantics, mode 0700) in the target's own folder, so nobody else can swap it for a link,
and the rename is on one file system. `os.replace` then puts the result in place: it replaces a
link at the target path itself, never the link's target. The write errors users meet (disk full,
a read-only folder, a file-size limit) become one ValueError line naming the path.
"""
import errno
import os
import shutil
import tempfile
from contextlib import contextmanager

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


@contextmanager
def _private_folder(target):
    parent = os.path.dirname(os.path.abspath(target)) or "."
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    except OSError as e:
        raise write_error(e, target) or e from None
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_path(path):
    """Yield the path of a new empty regular file to write `path`'s content into; on success it
    replaces `path`, on failure it is removed and `path` is left as it was."""
    with _private_folder(path) as folder:
        tmp = os.path.join(folder, os.path.basename(path))
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
            yield tmp
            os.replace(tmp, path)
        except OSError as e:
            raise write_error(e, path) or e from None


@contextmanager
def atomic_dir(folder):
    """Yield a new empty folder to write `folder`'s content into; on success it takes `folder`'s
    place (a previous `folder` is removed, a link at `folder` is replaced, not followed), on
    failure it is removed."""
    folder = os.path.abspath(folder)
    with _private_folder(folder) as private:
        tmp = os.path.join(private, "new")
        old = os.path.join(private, "old")
        try:
            os.mkdir(tmp)
            yield tmp
            if os.path.lexists(folder):
                os.replace(folder, old)  # removed with `private`
            os.replace(tmp, folder)
        except OSError as e:
            raise write_error(e, folder) or e from None


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
