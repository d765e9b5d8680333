"""Control messages of the all-reduce protocols (bulk session setup, votes, exchanges).

A message is a 4-byte big-endian length and a msgpack map. The length is checked against
MAX_CONTROL_MSG before a byte of the body is read, and the body is decoded with msgpack's
own container limits, so a hostile peer can make us read at most 4 KiB per message. Pure:
no I/O (the readers in `p2ptrain.reduce.service` feed these functions).
"""

from __future__ import annotations

import msgpack

MAX_CONTROL_MSG = 4096


def pack(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


class ControlError(ValueError):
    """A session-setup or vote message that must be dropped (oversize, malformed)."""


def check_control_length(header: bytes) -> int:
    n = int.from_bytes(header, "big")
    if n > MAX_CONTROL_MSG:
        raise ControlError(f"oversize: control message of {n} bytes > {MAX_CONTROL_MSG}")
    return n


def decode_control(body: bytes) -> dict:
    """A control message body (pure; the length was checked before it was read)."""
    if len(body) > MAX_CONTROL_MSG:
        raise ControlError(f"oversize: control message of {len(body)} bytes > {MAX_CONTROL_MSG}")
    try:
        obj = msgpack.unpackb(body, raw=False, max_bin_len=MAX_CONTROL_MSG, max_str_len=MAX_CONTROL_MSG,
                              max_array_len=64, max_map_len=16, max_ext_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ControlError(f"malformed: {type(exc).__name__}") from None
    if not isinstance(obj, dict):
        raise ControlError("malformed: control message is not a map")
    return obj
