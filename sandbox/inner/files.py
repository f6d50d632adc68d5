"""Reading and writing workspace files for the host without following anything a run planted
(``O_NOFOLLOW`` walks below a directory fd; contents copied by the kernel).
"""

import os

from .payload import copy_span


def _safe_open_parent(root_fd, rel, create_dirs):
    """Walk ``rel`` below ``root_fd`` without following symlinks; return (dir_fd, name)."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts):
        raise ValueError(f"bad path {rel!r}: use a relative path inside the workspace")
    fd = os.dup(root_fd)
    try:
        for part in parts[:-1]:
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create_dirs:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


def write_tree_file(root, rel, src, span, mode=0o644, owner=None):
    """Write blob ``span`` of payload memfd ``src`` to ``root/rel`` (kernel copy)."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        dfd, name = _safe_open_parent(root_fd, rel, create_dirs=True)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dfd)
            try:
                if owner is not None:
                    os.fchown(fd, owner[0], owner[1])
                copy_span(fd, src, span)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)
    finally:
        os.close(root_fd)


def read_tree_file(root, rel, limit):
    """A memfd holding ``root/rel`` (at most ``limit`` bytes, else ValueError), copied by the
    kernel: the file never passes through our memory and cannot change while it is sent."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        dfd, name = _safe_open_parent(root_fd, rel, create_dirs=False)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dfd)
            try:
                import stat as _stat
                if not _stat.S_ISREG(os.fstat(fd).st_mode):
                    raise IsADirectoryError(f"{rel!r} is not a regular file")
                out = os.memfd_create("read_file", os.MFD_CLOEXEC)
                total = 0
                try:
                    while total <= limit:
                        k = os.sendfile(out, fd, None, min(1 << 24, limit + 1 - total))
                        if not k:
                            break
                        total += k
                    if total > limit:
                        raise ValueError(f"{rel!r} is larger than {limit} bytes")
                except BaseException:
                    os.close(out)
                    raise
                return out, total
            finally:
                os.close(fd)
        finally:
            os.close(dfd)
    finally:
        os.close(root_fd)


def copy_tree(src, dst):
    """Copy the contents of directory ``src`` into the existing directory ``dst``: regular
    files by the kernel (sendfile), symlinks as links (never followed), directories with their
    modes; anything else (fifos, sockets) is skipped. Runs in a helper with the owner's uid."""
    with os.scandir(src) as entries:
        for entry in entries:
            s_path, d_path = entry.path, os.path.join(dst, entry.name)
            if entry.is_symlink():
                os.symlink(os.readlink(s_path), d_path)
            elif entry.is_dir(follow_symlinks=False):
                os.mkdir(d_path, entry.stat(follow_symlinks=False).st_mode & 0o7777)
                copy_tree(s_path, d_path)
            elif entry.is_file(follow_symlinks=False):
                mode = entry.stat(follow_symlinks=False).st_mode & 0o7777
                fin = os.open(s_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    fout = os.open(d_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                   mode)
                    try:
                        size = os.fstat(fin).st_size
                        off = 0
                        while off < size:
                            k = os.sendfile(fout, fin, off, size - off)
                            if not k:
                                break
                            off += k
                        os.fchmod(fout, mode)
                    finally:
                        os.close(fout)
                finally:
                    os.close(fin)
