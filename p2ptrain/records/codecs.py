"""Value codecs of a run's DHT records (pure: no I/O): ready, state, providers, reputation,
data and presence (the manifest's is `p2ptrain.records.manifest`).

This module imports neither trio, libp2p, torch nor the all-reduce, so a status client
decodes records without loading the trainer. Every decoder checks the byte size before
msgpack sees the value, caps every list, map and string, refuses a field of the wrong type
(never coerces it: issue 32), and raises `RecordError` -- the DHT layer's class, with its
reason tokens 'oversize' and 'malformed' -- for anything it refuses: callers drop the record
with a logged reason. The DHT already checked the record's signature and that its subkey is
the writer's peer id, so the peer a record speaks for is the subkey, never a field of the value.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import msgpack

from p2ptrain.dht.record import MAX_ADDRS, RecordError

__all__ = ["RecordError", "Ready", "State", "Provider", "DataRecord", "encode_ready", "decode_ready",
           "encode_state", "decode_state", "parse_counts", "encode_provider", "decode_provider", "encode_report",
           "decode_report", "encode_data", "decode_data", "encode_presence", "decode_presence"]

MAX_READY_BYTES = 16 * 1024
MAX_STATE_BYTES = 16 * 1024
MAX_PROVIDER_BYTES = 8 * 1024
MAX_REPORT_BYTES = 8 * 1024
MAX_DATA_BYTES = 2048
MAX_PRESENCE_BYTES = 4096
MAX_ADDR_CHARS = 512
MAX_MEMBERS = 64
"""Most members a provider record names (a group is never larger)."""
MAX_FLAGGED = 64
"""Most peers one reputation report names (the most recently flagged)."""
MAX_CONNS = 32
"""Neighbours listed in a presence record: keeps it well under MAX_PRESENCE_BYTES."""
KINDS = ("direct", "hole-punched", "relayed")  # = p2ptrain.net.connkinds.KINDS, without libp2p


def _unpack(value: bytes, limit: int, what: str, *, arrays: int = MAX_ADDRS, maps: int = 16,
            strs: int = MAX_ADDR_CHARS) -> dict:
    if len(value) > limit:
        raise RecordError("oversize", f"{what} record of {len(value)} bytes is over {limit}")
    try:
        obj = msgpack.unpackb(value, raw=False, max_array_len=arrays, max_map_len=maps, max_str_len=strs,
                              max_bin_len=0, max_ext_len=0)
    except Exception:
        raise RecordError("malformed", f"{what} record is not valid msgpack") from None
    if not isinstance(obj, dict):
        raise RecordError("malformed", f"{what} record is not a map")
    return obj


def _strings(value, what: str, cap: int = MAX_ADDRS) -> tuple[str, ...]:
    """A list of strings (absent: none); anything else is malformed, not "none"."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise RecordError("malformed", f"{what} is not a list of strings")
    return tuple(value[:cap])


def _number(x) -> bool:
    """An int or a float, never a bool (msgpack's True is Python's 1)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _hex64(x: object, what: str) -> str:
    if not (isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdefABCDEF" for c in x)):
        raise RecordError("malformed", f"{what} is not a sha256 hex digest")
    return x


# -- ready/<t> ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    peer: str
    ready_at: float
    addrs: tuple[str, ...] = ()
    joining: bool = False
    """A newcomer that just adopted the current state and contributes a zero
    pseudo-gradient: it is ready at once, so it must not start the step's clock."""
    tries: int = 0
    """The writer's try of the step (rule T7: 0, or one more than the round tag of its last
    try nobody committed). A group's round tag is the largest its members posted."""
    boot: str = ""
    """The writer process's incarnation (rule E11: a random hex nonce per start, also in its
    state records): a ready record of an earlier incarnation is stale."""


MAX_TRIES = 1 << 20
MAX_BOOT = 32


def encode_ready(ready_at: float, addrs: list[str], joining: bool, tries: int = 0, boot: str = "") -> bytes:
    obj = {"ready_at": ready_at, "addrs": list(addrs)[:MAX_ADDRS], "joining": joining}
    if tries:
        obj["try"] = tries
    if boot:
        obj["boot"] = boot
    return msgpack.packb(obj)


def _boot(obj: dict, what: str) -> str:
    boot = obj.get("boot", "")
    if not (isinstance(boot, str) and len(boot) <= MAX_BOOT):
        raise RecordError("malformed", f"{what} record's boot is not a string of at most {MAX_BOOT} characters")
    return boot


def decode_ready(peer: str, value: bytes) -> Ready:
    obj = _unpack(value, MAX_READY_BYTES, "ready")
    ready_at, joining = obj.get("ready_at"), obj.get("joining", False)
    if not _number(ready_at):  # a string "1e9" or True is not a time
        raise RecordError("malformed", "ready record has no ready_at")
    if not math.isfinite(ready_at):
        raise RecordError("malformed", "ready record's ready_at is not finite")
    if not isinstance(joining, bool):
        raise RecordError("malformed", "ready record's joining is not a bool")
    tries = obj.get("try", 0)
    if not (isinstance(tries, int) and not isinstance(tries, bool) and 0 <= tries <= MAX_TRIES):
        raise RecordError("malformed", "ready record's try is not an int in 0..2**20")
    return Ready(peer, float(ready_at), _strings(obj.get("addrs"), "addrs"), joining, tries, _boot(obj, "ready"))


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
    boot: str = ""
    """The writer process's incarnation (`Ready.boot`, rule E11)."""

    def to_dict(self) -> dict:
        return {"step": self.step, "params": self.params, "ckpt": self.ckpt, "loss": self.loss,
                "val_loss": self.val_loss, "addrs": list(self.addrs), "conns": dict(self.conns)}


def _finite_or_none(x) -> float | None:
    return round(float(x), 5) if _number(x) and math.isfinite(x) else None


def encode_state(s: State) -> bytes:
    return msgpack.packb({"step": s.step, "params": s.params, "ckpt": s.ckpt, "addrs": list(s.addrs)[:MAX_ADDRS],
                          "loss": _finite_or_none(s.loss), "val_loss": _finite_or_none(s.val_loss),
                          "conns": dict(s.conns), **({"boot": s.boot} if s.boot else {})})


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
        raise RecordError("malformed", f"state record has no {exc.args[0]}") from None
    if type(step) is not int or not 0 <= step < 1 << 40:
        raise RecordError("malformed", "state record's step is not a small non-negative integer")
    if not (isinstance(params, str) and isinstance(ckpt, str)):
        raise RecordError("malformed", "state record's hashes are not strings")
    if any(obj.get(k) is not None and not _number(obj[k]) for k in ("loss", "val_loss")):
        raise RecordError("malformed", "state record's losses are not numbers")
    if obj.get("conns") is not None and not isinstance(obj["conns"], dict):
        raise RecordError("malformed", "state record's conns is not a map")
    return State(step, params[:64], ckpt[:64], _finite_or_none(obj.get("loss")), _finite_or_none(obj.get("val_loss")),
                 _strings(obj.get("addrs"), "addrs"), parse_counts(obj.get("conns")), _boot(obj, "state"))


# -- providers ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Provider:
    peer: str                 # the signer (the DHT record's subkey), as a peer id string
    step: int
    manifest: str             # SHA-256 of the chunk manifest (p2ptrain.ckpt.chunks)
    sha256: str               # SHA-256 of the whole checkpoint blob
    params: str               # params_sha256 after the step (for logs and tests)
    members: tuple[str, ...]  # the group that committed `step` (empty at step 0)
    addrs: tuple[str, ...]


def encode_provider(step: int, manifest: str, sha256: str, params: str, members: list[str],
                    addrs: list[str]) -> bytes:
    value = msgpack.packb({"step": int(step), "manifest": manifest, "sha256": sha256, "params": params,
                           "members": sorted(members)[:MAX_MEMBERS], "addrs": list(addrs)[:MAX_ADDRS]})
    if len(value) > MAX_PROVIDER_BYTES:
        raise RecordError("oversize", "provider record is too large")
    return value


def decode_provider(peer: str, value: bytes) -> Provider:
    """One provider record's value, signed by `peer` (already checked by the DHT layer)."""
    v = _unpack(value, MAX_PROVIDER_BYTES, "provider", arrays=MAX_MEMBERS)
    step = v.get("step")
    if type(step) is not int or step < 0:  # not a bool
        raise RecordError("malformed", "provider record's step is not a non-negative integer")
    # A string is not a list (iterating one gave its characters as members); nor is nil.
    members, addrs = v.get("members", []), v.get("addrs", [])
    if members is None or addrs is None:
        raise RecordError("malformed", "provider record's members and addrs must be lists of strings")
    members = _strings(members, "provider record's members", MAX_MEMBERS)
    addrs = _strings(addrs, "provider record's addrs")
    return Provider(peer, step, _hex64(v.get("manifest"), "manifest"), _hex64(v.get("sha256"), "sha256"),
                    _hex64(v.get("params"), "params"), members, addrs)


# -- reputation ---------------------------------------------------------------------------
def encode_report(flagged: dict[str, int]) -> bytes:
    """Our report: the MAX_FLAGGED most recently flagged peers."""
    newest = sorted(flagged.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_FLAGGED]
    return msgpack.packb({"flagged": dict(newest)}, use_bin_type=True)


def decode_report(data: bytes) -> dict[str, int]:
    """{peer: step}; one entry of the wrong type refuses the whole report."""
    obj = _unpack(data, MAX_REPORT_BYTES, "reputation", arrays=0, maps=MAX_FLAGGED, strs=128)
    flagged = obj.get("flagged")
    if not isinstance(flagged, dict):
        raise RecordError("malformed", "reputation record has no flagged map")
    out = {p: s for p, s in flagged.items() if isinstance(p, str) and type(s) is int and s >= 0}
    if len(out) != len(flagged):
        raise RecordError("malformed", "reputation record names a peer or step of the wrong type")
    return out


# -- data ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataRecord:
    """A peer serving the run's token stream (the chunk manifest `manifest` of the blob
    `sha256`) and tokenizer (`tok`, its SHA-256; '' for none)."""
    manifest: str
    sha256: str
    tok: str
    addrs: tuple[str, ...] = ()


def encode_data(rec: DataRecord) -> bytes:
    return msgpack.packb({"manifest": rec.manifest, "sha256": rec.sha256, "tok": rec.tok,
                          "addrs": list(rec.addrs)[:MAX_ADDRS]})


def decode_data(value: bytes) -> DataRecord:
    obj = _unpack(value, MAX_DATA_BYTES, "data", maps=8)
    tok = obj.get("tok")
    if tok != "":  # '' is "no tokenizer"; anything else names one by its hash
        _hex64(tok, "data record's tok")
    return DataRecord(_hex64(obj.get("manifest"), "manifest"), _hex64(obj.get("sha256"), "sha256"), tok,
                      _strings(obj.get("addrs"), "data record's addrs"))


# -- presence ------------------------------------------------------------------------------
def encode_presence(addrs: list[str], role: str, conns: dict[str, str] | None = None, run: str | None = None,
                    left: bool = False) -> bytes:
    """`conns`: neighbour peer id -> connection kind (p2ptrain.net.nat.connection_kinds);
    `run`: the run a lobby record's peer trains in; `left`: the peer left cleanly."""
    obj: dict = {"addrs": [] if left else addrs[:MAX_ADDRS], "role": role}
    if conns and not left:
        obj["conns"] = dict(sorted(conns.items())[:MAX_CONNS])
    if run:
        obj["run"] = run
    if left:
        obj["left"] = True
    return msgpack.packb(obj, use_bin_type=True)


RUN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
"""A run named in a lobby record: `status` prints it to a terminal."""


def decode_presence(value: bytes) -> dict:
    """{"addrs", "role", "conns", "run", "left"}. Addresses that are not strings and
    neighbours of an unknown kind are only left out; a field of the wrong type refuses the
    record, and so does a run name `status` could not print safely."""
    obj = _unpack(value, MAX_PRESENCE_BYTES, "presence", maps=MAX_CONNS, strs=512)
    addrs, role, conns = obj.get("addrs"), obj.get("role", ""), obj.get("conns", {})
    if not isinstance(addrs, list):
        raise RecordError("malformed", "presence record's addrs is not a list")
    if not isinstance(role, str) or not isinstance(conns, dict):  # str() made a role of anything
        raise RecordError("malformed", "presence record's role or conns is of the wrong type")
    run, left = obj.get("run"), obj.get("left", False)
    if run is not None and not (isinstance(run, str) and RUN_NAME.fullmatch(run)):
        raise RecordError("malformed", "presence record's run is not a plain name")
    if not isinstance(left, bool):
        raise RecordError("malformed", "presence record's left is not a bool")
    return {"addrs": [a for a in addrs if isinstance(a, str)], "role": role,
            "conns": {k: v for k, v in conns.items() if isinstance(k, str) and v in KINDS},
            "run": run, "left": left}
