"""The wire format, both directions: 4-byte big-endian frame length, 4-byte header length, a
JSON header and raw blobs whose lengths are listed in ``header["blobs"]``.

The host imports this module too (``palaestra.sandbox.zygote``): it must stay standard library
only and free of side effects.
"""

import json
import struct


def pack(header, blobs=()):
    header = dict(header, blobs=[len(b) for b in blobs])
    head = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([struct.pack(">I", len(head)), head, *blobs])
    return struct.pack(">I", len(body)) + body


class FrameReader:
    """Accumulates bytes and yields complete ``(header, blobs)`` frames."""

    def __init__(self, max_frame):
        self.buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data):
        self.buf += data
        frames = []
        while len(self.buf) >= 4:
            (size,) = struct.unpack_from(">I", self.buf)
            if size > self.max_frame:
                raise ValueError(f"frame of {size} bytes exceeds the limit")
            if len(self.buf) < 4 + size:
                break
            body = bytes(self.buf[4:4 + size])
            del self.buf[:4 + size]
            (hlen,) = struct.unpack_from(">I", body)
            header = json.loads(body[4:4 + hlen])
            blobs, pos = [], 4 + hlen
            for n in header.get("blobs", []):
                blobs.append(body[pos:pos + n])
                pos += n
            frames.append((header, blobs))
        return frames
