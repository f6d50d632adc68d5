"""The host channel and payload moves: request blobs go from the channel into memfds and
outputs from memfds back to the host, copied by the kernel (splice, sendfile), never through
the zygote's own memory.
"""

import ctypes
import errno
import json
import os
import select
import struct

#: Requests whose blobs are payload (handed on as a memfd, never read by the zygote).
PAYLOAD_OPS = ("run", "cell", "write_file")


# What a run receives (code, argv, stdin, files) and what it prints are *payload*. The zygote
# never holds payload bytes in its own memory: every later run is a fork of it and could scan
# its inherited heap (freed memory included) for an earlier run's hidden tests or output. The
# kernel moves payloads instead: splice() from the host channel into a memfd, sendfile() from
# memfds into files, to the host, or into a run's stdin. Only the small JSON headers (ids,
# limits, paths chosen by the host) are parsed here.
def blob_spans(sizes):
    """(offset, length) of each blob of a payload memfd, from the header's size list."""
    spans, pos = [], 0
    for n in sizes:
        spans.append((pos, int(n)))
        pos += int(n)
    return spans


def read_span(fd, span):
    """A blob's bytes (only ever called in the run or kernel that owns the payload)."""
    off, n = span
    parts = []
    while n:
        part = os.pread(fd, n, off)
        if not part:
            raise OSError(errno.EIO, "payload ended early")
        parts.append(part)
        off += len(part)
        n -= len(part)
    return b"".join(parts)


def copy_span(dst, src, span):
    """Copy a blob of ``src`` to ``dst``'s file position, inside the kernel (sendfile)."""
    off, n = span
    while n:
        k = os.sendfile(dst, src, off, n)
        if not k:
            raise OSError(errno.EIO, "payload ended early")
        off += k
        n -= k


def span_memfd(src, span, name):
    """A fresh memfd holding one blob, positioned at its start (a run's stdin)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        copy_span(fd, src, span)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _wait(fd, write=False):
    select.select([] if write else [fd], [fd] if write else [], [])


class _Bounce:
    """Fallback copy through one fixed buffer that is zeroed after every use, for channels
    the kernel cannot splice (no new bytes object is ever made from a payload)."""

    def __init__(self, size=1 << 16):
        self.buf = bytearray(size)
        self.addr = ctypes.addressof((ctypes.c_char * size).from_buffer(self.buf))

    def move(self, src, dst, n, src_off=None):
        view = memoryview(self.buf)
        try:
            while n:
                want = min(n, len(self.buf))
                try:
                    k = (os.readv(src, [view[:want]]) if src_off is None
                         else os.preadv(src, [view[:want]], src_off))
                except BlockingIOError:
                    _wait(src)
                    continue
                if not k:
                    return n  # short: the caller decides
                done = 0
                while done < k:
                    try:
                        done += os.write(dst, view[done:k])
                    except BlockingIOError:
                        _wait(dst, write=True)
                n -= k
                if src_off is not None:
                    src_off += k
            return 0
        finally:
            view.release()
            ctypes.memset(self.addr, 0, len(self.buf))


class Channel:
    """The host link, read exactly one frame at a time: the header into memory, the payload
    (the frame's blobs) moved by the kernel straight into a memfd."""

    def __init__(self, fd_in, fd_out):
        self.fd_in, self.fd_out = fd_in, fd_out
        self.pipe_r, self.pipe_w = os.pipe2(os.O_CLOEXEC)
        try:
            import fcntl
            fcntl.fcntl(self.pipe_w, fcntl.F_SETPIPE_SZ, 1 << 20)
            self.pipe_cap = fcntl.fcntl(self.pipe_w, fcntl.F_GETPIPE_SZ)
        except OSError:
            self.pipe_cap = 1 << 16
        self.splice_in = self.send_out = True
        self.bounce = None

    def _read_exact(self, n, first=None):
        parts = [first] if first else []
        n -= len(first or b"")
        while n > 0:
            try:
                data = os.read(self.fd_in, n)
            except BlockingIOError:
                _wait(self.fd_in)
                continue
            except InterruptedError:
                continue
            if not data:
                return None
            parts.append(data)
            n -= len(data)
        return b"".join(parts)

    def read_head(self, block=True):
        """(header, payload size) of the next frame; None at EOF; False when none waits
        (``block=False``)."""
        try:
            first = os.read(self.fd_in, 8)
        except BlockingIOError:
            if not block:
                return False
            first = b""
        except InterruptedError:
            first = b""
        if not first and not block:
            return None
        prefix = self._read_exact(8, first)
        if prefix is None:
            return None
        size, hlen = struct.unpack(">II", prefix)
        head = self._read_exact(hlen)
        if head is None:
            return None
        return json.loads(head), size - 4 - hlen

    def read_payload_bytes(self, n):
        """A payload that the zygote itself needs (the seccomp filter of ``init``)."""
        return self._read_exact(n) if n else b""

    def payload_memfd(self, n):
        """The next ``n`` bytes of the channel in a fresh memfd, never in our memory."""
        fd = os.memfd_create("payload", os.MFD_CLOEXEC)
        try:
            while n and self.splice_in:
                try:
                    k = os.splice(self.fd_in, self.pipe_w, min(n, self.pipe_cap))
                except BlockingIOError:
                    _wait(self.fd_in)
                    continue
                except InterruptedError:
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    self.splice_in = False
                    break
                if not k:
                    raise EOFError("the host closed the channel mid-frame")
                n -= k
                while k:
                    k -= os.splice(self.pipe_r, fd, k)
            if n:
                self.bounce = self.bounce or _Bounce()
                if self.bounce.move(self.fd_in, fd, n):
                    raise EOFError("the host closed the channel mid-frame")
            return fd
        except BaseException:
            os.close(fd)
            raise

    def write_all(self, data):
        data = memoryview(data)
        while data:
            try:
                data = data[os.write(self.fd_out, data):]
            except InterruptedError:
                continue
            except BlockingIOError:  # the channel is non-blocking: wait until the host reads
                _wait(self.fd_out, write=True)

    def send(self, header, blobs=(), fds=()):
        """One frame: ``blobs`` from memory, then each ``(fd, n)`` of ``fds`` (the first n
        bytes of a memfd) copied by the kernel. A file shorter than announced is padded."""
        sizes = [len(b) for b in blobs] + [n for _, n in fds]
        head = json.dumps(dict(header, blobs=sizes), separators=(",", ":")).encode()
        total = 4 + len(head) + sum(sizes)
        self.write_all(b"".join([struct.pack(">II", total, len(head)), head, *blobs]))
        for fd, n in fds:
            off = 0
            while off < n and self.send_out:
                try:
                    k = os.sendfile(self.fd_out, fd, off, n - off)
                except BlockingIOError:
                    _wait(self.fd_out, write=True)
                    continue
                except InterruptedError:
                    continue
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                        raise
                    self.send_out = False
                    break
                if not k:
                    break
                off += k
            if off < n and not self.send_out:
                self.bounce = self.bounce or _Bounce()
                off = n - self.bounce.move(fd, self.fd_out, n - off, src_off=off)
            if off < n:
                self.write_all(bytes(n - off))
