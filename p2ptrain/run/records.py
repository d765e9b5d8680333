"""Codecs of a run's DHT records: `ready` (one per outer step) and `state` (pure: no I/O).

Readers are `p2ptrain.run.elect` (the trainer's election), `p2ptrain.run.states` (catch-up,
`p2ptrain status`, the dashboard). This module imports neither trio, libp2p, torch nor the
all-reduce, so a status client decodes records without loading the trainer.

Every decoder checks the byte size before msgpack sees the value, caps every list and string,
and raises `RecordError` (a ValueError) for anything malformed: callers drop the record with a
logged reason. The DHT already checked the record's signature and that its subkey is the
writer's peer id, so the peer a record speaks for is the subkey, never a field of the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgpack

from p2ptrain.run.election import Ready
from p2ptrain.run.keys import MAX_ADDRS

MAX_READY_BYTES = 16 * 1024
MAX_STATE_BYTES = 16 * 1024
MAX_ADDR_CHARS = 512
KINDS = ("direct", "hole-punched", "relayed")  # = p2ptrain.net.connkinds.KINDS, without libp2p


class RecordError(ValueError):
    pass


def _unpack(value: bytes, limit: int, what: str) -> dict:
    if len(value) > limit:
        raise RecordError(f"{what} record of {len(value)} bytes is over {limit}")
    try:
        obj = msgpack.unpackb(value, raw=False, max_array_len=MAX_ADDRS, max_map_len=16,
                              max_str_len=MAX_ADDR_CHARS, max_bin_len=0, max_ext_len=0)
    except Exception:
        raise RecordError(f"{what} record is not valid msgpack") from None
    if not isinstance(obj, dict):
        raise RecordError(f"{what} record is not a map")
    return obj


def _addrs(value) -> tuple[str, ...]:
    """A list of address strings (absent: none); anything else is malformed, not "none"."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise RecordError("addrs is not a list of strings")
    return tuple(value[:MAX_ADDRS])


def _number(x) -> bool:
    """An int or a float, never a bool (msgpack's True is Python's 1)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# -- ready/<t> ----------------------------------------------------------------------------
def encode_ready(ready_at: float, addrs: list[str], joining: bool) -> bytes:
    return msgpack.packb({"ready_at": ready_at, "addrs": list(addrs)[:MAX_ADDRS], "joining": joining})


def decode_ready(peer: str, value: bytes) -> Ready:
    obj = _unpack(value, MAX_READY_BYTES, "ready")
    ready_at, joining = obj.get("ready_at"), obj.get("joining", False)
    if not _number(ready_at):  # a string "1e9" or True is not a time
        raise RecordError("ready record has no ready_at")
    if not math.isfinite(ready_at):
        raise RecordError("ready record's ready_at is not finite")
    if not isinstance(joining, bool):
        raise RecordError("ready record's joining is not a bool")
    return Ready(peer, float(ready_at), _addrs(obj.get("addrs")), joining)


# -- state --------------------------------------------------------------------------------
@dataclass(frozen=True)
class State:
    """A member's newest state: its outer step, params hash and checkpoint hash (what a
    newcomer fetches), its losses and how it is connected (what `status` shows)."""
    step: int
    params: str
    ckpt: str
    loss: float | None = None
    val_loss: float | None = None
    addrs: tuple[str, ...] = ()
    conns: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"step": self.step, "params": self.params, "ckpt": self.ckpt, "loss": self.loss,
                "val_loss": self.val_loss, "addrs": list(self.addrs), "conns": dict(self.conns)}


def _finite_or_none(x) -> float | None:
    return round(float(x), 5) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def encode_state(s: State) -> bytes:
    return msgpack.packb({"step": s.step, "params": s.params, "ckpt": s.ckpt, "addrs": list(s.addrs)[:MAX_ADDRS],
                          "loss": _finite_or_none(s.loss), "val_loss": _finite_or_none(s.val_loss),
                          "conns": dict(s.conns)})


def parse_counts(value) -> dict[str, int]:
    """Published connection counts, checked: known kinds only, small non-negative ints."""
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items()
            if k in KINDS and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 20}


def decode_state(value: bytes) -> State:
    obj = _unpack(value, MAX_STATE_BYTES, "state")
    try:
        step, params, ckpt = obj["step"], obj["params"], obj["ckpt"]
    except KeyError as exc:
        raise RecordError(f"state record has no {exc.args[0]}") from None
    if type(step) is not int or not 0 <= step < 1 << 40:
        raise RecordError("state record's step is not a small non-negative integer")
    if not (isinstance(params, str) and isinstance(ckpt, str)):
        raise RecordError("state record's hashes are not strings")
    if any(obj.get(k) is not None and not _number(obj[k]) for k in ("loss", "val_loss")):
        raise RecordError("state record's losses are not numbers")
    if obj.get("conns") is not None and not isinstance(obj["conns"], dict):
        raise RecordError("state record's conns is not a map")
    return State(step, params[:64], ckpt[:64], _finite_or_none(obj.get("loss")), _finite_or_none(obj.get("val_loss")),
                 _addrs(obj.get("addrs")), parse_counts(obj.get("conns")))
