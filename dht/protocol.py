"""DHT wire messages: framing and size-limited decoding (pure: no I/O).

A frame is a 4-byte big-endian length and a msgpack body. The length is checked against the
limit before a single body byte is read, and msgpack itself is bounded (container and
string sizes), so a hostile peer cannot make a node allocate more than one frame's worth.

Requests:  [req_id, method, body]     Replies: [req_id, ok, body_or_reason]
"""

from __future__ import annotations

import struct

import msgpack

from p2ptrain.dht.record import MAX_ADDRS

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 512 * 1024
METHODS = frozenset({"ping", "find", "get", "store"})


class FrameError(ValueError):
    """A frame that must be dropped; `reason` is a short stable token for logs."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def check_length(header: bytes, max_frame: int) -> int:
    if len(header) != HEADER.size:
        raise FrameError("truncated", f"{len(header)}-byte frame header")
    (n,) = HEADER.unpack(header)
    if n > max_frame:
        raise FrameError("oversize", f"frame of {n} bytes > limit {max_frame}")
    return n


def _unpack(body: bytes, max_frame: int) -> object:
    try:
        return msgpack.unpackb(
            body, raw=False, strict_map_key=True, max_bin_len=max_frame, max_str_len=max_frame,
            max_array_len=4096, max_map_len=64, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many unrelated types on garbage
        raise FrameError("malformed", type(exc).__name__) from None


def decode_request(body: bytes, max_frame: int) -> tuple[int, str, dict]:
    obj = _unpack(body, max_frame)
    if not (isinstance(obj, list) and len(obj) == 3 and type(obj[0]) is int  # not a bool
            and isinstance(obj[1], str) and obj[1] in METHODS and isinstance(obj[2], dict)):
        raise FrameError("malformed", "expected [req_id, method, body]")
    return obj[0], obj[1], obj[2]


def decode_reply(body: bytes, max_frame: int) -> tuple[int, bool, object]:
    obj = _unpack(body, max_frame)
    if not (isinstance(obj, list) and len(obj) == 3 and type(obj[0]) is int and isinstance(obj[1], bool)):
        raise FrameError("malformed", "expected [req_id, ok, body]")
    return obj[0], obj[1], obj[2]


def encode_peers(entries: list[tuple[bytes, list[str]]]) -> list[list]:
    return [[pid, addrs] for pid, addrs in entries]


def decode_peers(obj: object, limit: int = 64) -> list[tuple[bytes, list[str]]]:
    """Peer lists from other nodes: malformed entries are skipped, never trusted."""
    out: list[tuple[bytes, list[str]]] = []
    if not isinstance(obj, list):
        return out
    for item in obj[:limit]:
        if (isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes)
                and isinstance(item[1], list)):
            addrs = [a for a in item[1][:MAX_ADDRS] if isinstance(a, str) and len(a) < 512]
            out.append((item[0], addrs))
    return out
