"""Fuzzing every decoder of network input (issue 7): random bytes, mutated valid messages
and oversize inputs. Each decoder must either return or raise its documented rejection
(an exception type with a reason), never anything else, and must not allocate much more
than its size limit (tracemalloc peak). Hypothesis runs derandomized with fixed example
counts, so CI sees the same inputs on every run; the whole file takes ~20 s.
"""

from __future__ import annotations

import hashlib
import tracemalloc

import msgpack
import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.reduce import bulk
from p2ptrain.ckpt import checkpoint
from p2ptrain.run import contribution, influence
from p2ptrain.reduce import control
from p2ptrain.ckpt import fetch
from p2ptrain.run import manifest
from p2ptrain.dht import protocol, record
from p2ptrain.dht.node import DHTNode
from p2ptrain.dht.transport import MemoryNetwork, RpcError
from p2ptrain.identity import Identity
from p2ptrain.train.local import decode_state  # imports torch: never under tracemalloc (slow)
from p2ptrain.reduce.ring import FrameId, RingError

FUZZ = settings(max_examples=100, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
FEW = settings(FUZZ, max_examples=40)

ID_A = Identity.from_seed(b"\x01" * 32)
ID_B = Identity.from_seed(b"\x02" * 32)
NOW = 1_800_000_000.0
SLACK = 512 * 1024


def rejects(fn, data, errors, limit_bytes: int):
    """Run one decoder on `data`: it returns or raises one of `errors`; its allocation peak
    stays below `limit_bytes`. Returns the result or the exception."""
    for _ in range(2):  # measured on the second call: the first fills one-off caches
        tracemalloc.start()  # only around the decoder: tracing hypothesis itself is slow
        try:
            out = fn(data)
        except errors as exc:
            out = exc
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    # Slack for fixed allocations: msgpack.packb (signatures are over msgpack) starts with a
    # 256 KiB buffer whatever it packs; frames and exception objects are small.
    assert peak < limit_bytes + SLACK, f"{fn.__name__} allocated {peak} bytes on a {len(data)}-byte input"
    return out


@st.composite
def mutated(draw, valid: bytes):
    """A valid message with a few byte flips, truncations, insertions or splices."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "dup"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[pos] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        else:
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 64))]
    return bytes(data)


def inputs(valid: bytes):
    return st.one_of(st.binary(max_size=2048), mutated(valid))


# -- DHT frames and records --------------------------------------------------------------
VALID_REQ = protocol.frame([7, "store", {"records": [b"x" * 40], "srv": True, "addrs": ["/ip4/1.2.3.4"]}])
VALID_REC = record.make_record(ID_A, "/p2ptrain/run/state", b"value" * 10, NOW + 60).encode()


@FUZZ
@given(inputs(VALID_REQ[4:]))
def test_dht_frame_bodies(body):
    for fn in (lambda b: protocol.decode_request(b, protocol.DEFAULT_MAX_FRAME),
               lambda b: protocol.decode_reply(b, protocol.DEFAULT_MAX_FRAME)):
        rejects(fn, body, protocol.FrameError, 64 * 1024 + 8 * len(body))
    try:  # peer lists inside a reply: whatever the structure, only well-formed entries come out
        obj = protocol._unpack(body, protocol.DEFAULT_MAX_FRAME)
    except protocol.FrameError:
        return
    for item in (obj, [obj], obj.get("peers") if isinstance(obj, dict) else None):
        peers = rejects(protocol.decode_peers, item, (), 64 * 1024 + 8 * len(body))
        assert all(isinstance(p, bytes) and all(isinstance(a, str) for a in addrs) for p, addrs in peers)


@FEW
@given(st.integers(0, 2**32 - 1))
def test_dht_frame_length_checked_before_body(n):
    header = protocol.HEADER.pack(n)
    out = rejects(lambda h: protocol.check_length(h, protocol.DEFAULT_MAX_FRAME), header, protocol.FrameError, 4096)
    assert (out == n) if n <= protocol.DEFAULT_MAX_FRAME else out.reason == "oversize"


@FUZZ
@given(inputs(VALID_REC))
def test_dht_records(data):
    out = rejects(lambda d: record.decode_and_validate(d, NOW, 3600.0, 60.0), data, record.RecordError,
                  32 * 1024 + 4 * len(data))
    if isinstance(out, record.Record):  # anything accepted is exactly the signed record
        assert out.encode() == VALID_REC


def test_dht_record_oversize_rejected_before_parsing():
    big = msgpack.packb([1, "/p2ptrain/k", b"s", b"v" * (1 << 20), NOW, b"k", b"s"])
    out = rejects(lambda d: record.decode(d), big, record.RecordError, 64 * 1024)
    assert out.reason == "oversize"


def _dht_node():
    net = MemoryNetwork()
    node = DHTNode(ID_A, net.transport(ID_A.peer_id))
    return node, net.nodes[ID_A.peer_id]


@FUZZ
@given(st.one_of(st.binary(max_size=2048), mutated(VALID_REQ),
                 st.builds(lambda b: protocol.HEADER.pack(len(b)) + b, mutated(VALID_REQ[4:]))))
def test_dht_server_survives_any_request(payload):
    """The whole serving path (framing, decoding, handler, record validation) of a real
    DHTNode: every input gets a reply frame or is dropped (RpcError), nothing else."""
    node, transport = _dht_node()

    async def serve(p):
        return await transport.receive(ID_B.peer_id, p)

    out = rejects(lambda p: trio.run(serve, p), payload, RpcError, 2 << 20)
    if isinstance(out, bytes):
        n = protocol.check_length(out[:4], protocol.DEFAULT_MAX_FRAME)
        protocol.decode_reply(out[4:4 + n], protocol.DEFAULT_MAX_FRAME)
    assert len(node.store_) <= 1


# -- contribution headers ----------------------------------------------------------------
H = contribution.Header("r" * 64, 3, 0, "h" * 64, ID_A.peer_id_str, (1.0, 2.0, 0.5),
                        ("a" * 64, "b" * 64), 2.3, 10, 4096)
VALID_HDR = contribution.sign_header(H, ID_A)


@FUZZ
@given(inputs(VALID_HDR))
def test_contribution_headers(data):
    out = rejects(contribution.decode_header, data, contribution.BadContribution, 64 * 1024 + 8 * len(data))
    if isinstance(out, contribution.Header):
        assert out == H
    ok, bad = rejects(lambda d: influence.verify_headers(
        {ID_A.peer_id_str: d, ID_B.peer_id_str: None}, H.run, H.step, H.attempt, H.roster,
        [ID_A.peer_id_str, ID_B.peer_id_str], {}), data, (), 64 * 1024 + 8 * len(data))
    assert set(ok) | set(bad) == {ID_A.peer_id_str, ID_B.peer_id_str}


def test_contribution_oversize():
    out = rejects(contribution.decode_header, b"\x00" * (1 << 20), contribution.BadContribution, 16 * 1024)
    assert out.reason == "oversize header"


# -- all-reduce control messages ---------------------------------------------------------
VALID_VOTE = msgpack.packb({"tag": b"t" * 8, "ok": True, "digest": "d" * 64, "blame": "", "reason": ""},
                           use_bin_type=True)


@FUZZ
@given(inputs(VALID_VOTE))
def test_control_messages(body):
    out = rejects(control.decode_control, body, control.ControlError, 32 * 1024)
    assert isinstance(out, (dict, control.ControlError))


@FEW
@given(st.integers(0, 2**32 - 1))
def test_control_length(n):
    out = rejects(control.check_control_length, n.to_bytes(4, "big"), control.ControlError, 4096)
    assert (out == n) if n <= control.MAX_CONTROL_MSG else isinstance(out, control.ControlError)


# -- bulk frames -------------------------------------------------------------------------
class BytesIO:
    """The bytes a peer sent, as a channel's IO (recv_wait/recv_into/sendall/close)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = memoryview(data), 0

    def recv_into(self, view: memoryview, limit: float | None = None) -> None:
        if self.pos + len(view) > len(self.data):
            raise RingError("peer closed the connection")
        view[:] = self.data[self.pos:self.pos + len(view)]
        self.pos += len(view)

    def recv_wait(self, view: memoryview) -> int:
        n = min(len(view), len(self.data) - self.pos)
        if n == 0:
            raise RingError("peer closed the connection")
        self.recv_into(view[:n])
        return n

    def sendall(self, parts) -> None:
        self.data = memoryview(b"".join(bytes(p) for p in parts))

    def close(self, graceful: bool = False) -> None:
        pass


KEY, TAG = b"k" * 32, b"t" * 8
FID = FrameId(1, 2)
PAYLOAD = bytes(range(256)) * 4


def _valid_frame() -> bytes:
    io = BytesIO(b"")
    bulk.FrameChannel(io, KEY, TAG, "peer").send(FID, memoryview(PAYLOAD))
    return bytes(io.data)


VALID_FRAME = _valid_frame()


@FUZZ
@given(st.one_of(st.binary(max_size=4096), mutated(VALID_FRAME)))
def test_bulk_frames(data):
    out = bytearray(len(PAYLOAD))

    def recv(d):
        return bulk.FrameChannel(BytesIO(d), KEY, TAG, "peer", max_bad_frames=2).recv(FID, memoryview(out))

    got = rejects(recv, data, RingError, 64 * 1024)
    if got == len(PAYLOAD):  # only an intact, authenticated frame is accepted
        assert bytes(out) == PAYLOAD


def test_bulk_frame_claiming_a_huge_length_allocates_nothing():
    hdr = bulk.HEADER.pack(bulk.MAGIC, bulk.VERSION, bulk.KIND_DATA, TAG, FID.step, FID.chunk, bulk.MAX_FRAME)
    out = bytearray(len(PAYLOAD))
    chan = bulk.FrameChannel(BytesIO(hdr + b"\x00" * 100), KEY, TAG, "peer")
    got = rejects(lambda d: chan.recv(FID, memoryview(out)), b"", RingError, 64 * 1024)
    assert "malformed header" in str(got)


# -- run manifests -----------------------------------------------------------------------
MANIFEST = manifest.sign({"version": 1, "name": "fuzz", "model": {"d_model": 64, "n_layers": 2},
                          "train": {"seed": 1, "outer_lr": 0.7, "allreduce": "int8"},
                          "timeouts": {"join_window": 30.0}}, ID_A)
VALID_MANIFEST = manifest.encode(MANIFEST)
RID = manifest.run_id(MANIFEST)


def _manifest(data: bytes) -> str:
    return manifest.verify_manifest(manifest.decode(data), RID)


@FUZZ
@given(inputs(VALID_MANIFEST))
def test_manifests(data):
    out = rejects(_manifest, data, manifest.ManifestError, 256 * 1024)
    assert out == RID or isinstance(out, manifest.ManifestError)


def test_manifest_deeply_nested_is_rejected_not_recursion_error():
    # A validly signed manifest could nest ~1000 levels within the size limit; hashing it
    # then raised RecursionError (a crash of the joining peer), now a ManifestError.
    deep = b"\x81\xa1a" * 1000 + b"\xc0"
    out = rejects(manifest.decode, deep, manifest.ManifestError, 1 << 20)
    assert "deeper" in str(out)
    out = rejects(manifest.decode, b"\x00" * (1 << 20), manifest.ManifestError, 64 * 1024)
    assert "over" in str(out)


# -- checkpoints -------------------------------------------------------------------------
ARRAYS = {"outer": np.arange(64, dtype=np.float32), "momentum": np.zeros(64, np.float32)}
VALID_CKPT = checkpoint.encode(ARRAYS, {"outer_step": 5, "steps": 5, "skipped": 0})


def _state(data: bytes):
    return decode_state(data)


@FUZZ
@given(st.one_of(st.binary(max_size=2048), mutated(VALID_CKPT)))
def test_checkpoints(data):
    out = rejects(checkpoint.decode, data, checkpoint.CheckpointError, 64 * 1024 + 4 * len(data))
    if not isinstance(out, Exception):
        arrays, meta = out
        assert all(a.nbytes <= len(data) for a in arrays.values()) and isinstance(meta, dict)
    rejects(_state, data, checkpoint.CheckpointError, 256 * 1024 + 8 * len(data))


def _ckpt_with(entries: list, meta=None) -> bytes:
    header = msgpack.packb({"meta": {} if meta is None else meta, "arrays": entries}, use_bin_type=True)
    return checkpoint.MAGIC + len(header).to_bytes(4, "big") + header + b"\x00" * 64


@pytest.mark.parametrize("entries,meta", [
    ([["a", "float32", [-1], 0, -4]], None),             # count -1 read the whole buffer before
    ([["a", "float32", [2**40, 2**40], 0, 0]], None),     # int64 overflow of the element count
    ([["a", "float32", [4], "0", 16]], None),             # non-integer offset: TypeError before
    ([["a", "object", [1], 0, 8]], None),                 # not a plain numeric dtype
    ([[["a"], "float32", [1], 0, 4]], None),              # unhashable name
    ([["a", "float32", [1], 0, 4], ["a", "float32", [1], 0, 4]], None),  # duplicate
    (7, None),                                            # arrays not a list: TypeError before
    ([], [1, 2]),                                         # meta not a map
])
def test_checkpoint_hostile_entries_rejected(entries, meta):
    out = rejects(checkpoint.decode, _ckpt_with(entries, meta), checkpoint.CheckpointError, 64 * 1024)
    assert isinstance(out, checkpoint.CheckpointError), out


def test_state_of_wrong_shape_is_a_checkpoint_error():
    for meta in ({"outer_step": -1}, {"outer_step": 1.5}, {"outer_step": 2**62}):
        with pytest.raises(checkpoint.CheckpointError):
            decode_state(checkpoint.encode(ARRAYS, meta))
    with pytest.raises(checkpoint.CheckpointError):
        decode_state(checkpoint.encode({"x": ARRAYS["outer"]}, {"outer_step": 1}))
    assert checkpoint.state_size_limit(1000) == 2000 + (1 << 20)


# -- blob fetch requests -----------------------------------------------------------------
VALID_FETCH = msgpack.packb({"sha256": hashlib.sha256(b"x").hexdigest()})


@FUZZ
@given(inputs(VALID_FETCH))
def test_fetch_requests(body):
    out = rejects(fetch.decode_request, body, fetch.FetchError, 16 * 1024)
    assert isinstance(out, fetch.FetchError) or (isinstance(out, str) and len(out) == 64)


def test_msgpack_limits_hold_for_declared_huge_containers():
    """A 5-byte msgpack header may declare a 4-billion-element array or a 4 GiB string:
    every decoder above must refuse it by its max_*_len options, not try to allocate."""
    for blob in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                 b"\xc6\xff\xff\xff\xff"):
        rejects(lambda b: protocol.decode_request(b, protocol.DEFAULT_MAX_FRAME), blob, protocol.FrameError, 1 << 20)
        rejects(record.decode, blob, record.RecordError, 1 << 20)
        rejects(contribution.decode_header, blob, contribution.BadContribution, 1 << 20)
        rejects(control.decode_control, blob, control.ControlError, 1 << 20)
        rejects(manifest.decode, blob, manifest.ManifestError, 1 << 20)
        rejects(fetch.decode_request, blob, fetch.FetchError, 1 << 20)
        rejects(checkpoint.decode, checkpoint.MAGIC + len(blob).to_bytes(4, "big") + blob,
                checkpoint.CheckpointError, 1 << 20)


# -- decoders added with checkpoints, NAT presence and reputation --------------------------
from p2ptrain.records import codecs  # noqa: E402
from p2ptrain.ckpt import chunks

VALID_CHUNKS = chunks.split(bytes(range(256)) * 64, 4096)[0].encode()
VALID_PROVIDER = codecs.encode_provider(3, "ab" * 32, "cd" * 32, "ef" * 32, [ID_A.peer_id_str, ID_B.peer_id_str],
                                        ["/ip4/127.0.0.1/tcp/1"])
VALID_REPORT = codecs.encode_report({ID_B.peer_id_str: 4})
VALID_PRESENCE = codecs.encode_presence(["/ip4/127.0.0.1/tcp/1"], "trainer", {ID_B.peer_id_str: "relayed"})


@FUZZ
@given(inputs(VALID_CHUNKS))
def test_chunk_manifests(data):
    out = rejects(chunks.decode_manifest, data, chunks.ChunkError, 256 * 1024)
    assert isinstance(out, (chunks.ChunkManifest, chunks.ChunkError))


def test_chunk_manifest_oversize_rejected_before_parsing():
    big = b"\x00" * (chunks.MAX_MANIFEST_BYTES + 1)
    out = rejects(chunks.decode_manifest, big, chunks.ChunkError, 64 * 1024)
    assert "over the limit" in str(out)


@FUZZ
@given(inputs(VALID_PROVIDER))
def test_provider_records(data):
    out = rejects(lambda d: codecs.decode_provider(ID_A.peer_id_str, d), data, codecs.RecordError, 256 * 1024)
    assert isinstance(out, (codecs.Provider, codecs.RecordError))


@FUZZ
@given(inputs(VALID_REPORT))
def test_reputation_reports(data):
    out = rejects(codecs.decode_report, data, ValueError, 256 * 1024)
    assert isinstance(out, (dict, ValueError))


@FUZZ
@given(inputs(VALID_PRESENCE))
def test_presence_records(data):
    out = rejects(codecs.decode_presence, data, codecs.RecordError, 256 * 1024)
    assert isinstance(out, (codecs.RecordError, dict))


# -- loose types (issue 32): a field of the wrong type is rejected, never coerced ----------
from p2ptrain.records import codecs as records  # noqa: E402
from p2ptrain.run import roster as roster_codec  # noqa: E402
from p2ptrain.reduce import commit as commit_codec  # noqa: E402
from p2ptrain.events import EventSink, SafeFormatter, clean  # noqa: E402

ADDR = "/ip4/1.2.3.4/tcp/1"
READY = {"ready_at": NOW, "addrs": [ADDR], "joining": False}
# What each field of a ready record may be; anything else must be refused.
READY_TYPES = {"ready_at": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
               "joining": lambda v: isinstance(v, bool),
               "addrs": lambda v: v is None or isinstance(v, list) and all(isinstance(a, str) for a in v)}
LOOSE = st.one_of(st.booleans(), st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=8),
                  st.binary(max_size=8), st.lists(st.one_of(st.integers(0, 3), st.text(max_size=4)), max_size=3),
                  st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2), st.none())


@FUZZ
@given(st.sampled_from(sorted(READY_TYPES)), LOOSE)
def test_ready_record_fields_of_the_wrong_type_are_refused(field, value):
    """Before: ready_at=True or "1.8e9" became a time (float()), joining="no" was True
    (bool()), and a string for addrs read as no addresses."""
    obj = dict(READY, **{field: value})
    try:
        out = records.decode_ready(ID_A.peer_id_str, msgpack.packb(obj))
    except records.RecordError:
        assert not READY_TYPES[field](value) or (field == "ready_at" and not np.isfinite(value))
    else:
        assert READY_TYPES[field](value) and isinstance(out.ready_at, float)


def _header_body(**change) -> dict:
    h = contribution.Header("run", 3, 0, "ab" * 32, ID_A.peer_id_str, (1.0, 2.0), ("cd" * 32,), 2.5, 10, 100)
    return dict(h.body(), **change)


def _signed(body: dict) -> bytes:
    return msgpack.packb({"h": body, "sig": ID_A.sign(contribution._payload(body))}, use_bin_type=True)


@pytest.mark.parametrize("change", [
    {"step": True}, {"attempt": "0"}, {"inner_steps": 9.5}, {"tokens": [100]}, {"norm": True}, {"norm": "2.5"},
    {"chunk_norms": "12"}, {"chunk_norms": [True]}, {"own_digests": "cd"}, {"own_digests": [7]}, {"run": 5},
    {"roster": b"ab"},
])
def test_contribution_headers_of_loose_types_are_refused_though_signed(change):
    """A header signed as sent, but with a field of another type. Before: step=True read as
    step 1, "12" as chunk norms (1.0, 2.0), "cd" as two digests, run=5 as "5"."""
    assert contribution.decode_header(_signed(_header_body())).step == 3  # the honest one passes
    with pytest.raises(contribution.BadContribution, match="malformed"):
        contribution.decode_header(_signed(_header_body(**change)))


def _provider(**change) -> bytes:
    obj = msgpack.unpackb(VALID_PROVIDER)
    obj.update(change)
    return msgpack.packb(obj)


@pytest.mark.parametrize("decoder, good, bad, error", [
    (lambda d: codecs.decode_provider(ID_A.peer_id_str, d), _provider(), _provider(step=True), codecs.RecordError),
    (lambda d: codecs.decode_provider(ID_A.peer_id_str, d), _provider(), _provider(members=ID_B.peer_id_str),
     codecs.RecordError),
    (lambda d: codecs.decode_provider(ID_A.peer_id_str, d), _provider(), _provider(addrs=ADDR), codecs.RecordError),
    (codecs.decode_report, VALID_REPORT, msgpack.packb({"flagged": {ID_B.peer_id_str: True}}), ValueError),
    (records.decode_state, records.encode_state(records.State(4, "a" * 64, "b" * 64)),
     msgpack.packb({"step": 4, "params": "a" * 64, "ckpt": "b" * 64, "loss": "0.5"}), records.RecordError),
    (records.decode_state, records.encode_state(records.State(4, "a" * 64, "b" * 64)),
     msgpack.packb({"step": 4, "params": "a" * 64, "ckpt": "b" * 64, "addrs": ADDR}), records.RecordError),
    (chunks.decode_manifest, VALID_CHUNKS, msgpack.packb(dict(msgpack.unpackb(VALID_CHUNKS), v=True)),
     chunks.ChunkError),
    (lambda d: protocol.decode_request(d, 1 << 20), msgpack.packb([7, "ping", {}]), msgpack.packb([True, "ping", {}]),
     protocol.FrameError),
    (lambda d: protocol.decode_request(d, 1 << 20), msgpack.packb([7, "ping", {}]), msgpack.packb([7, ["ping"], {}]),
     protocol.FrameError),
    (lambda d: protocol.decode_reply(d, 1 << 20), msgpack.packb([7, True, {}]), msgpack.packb([False, True, {}]),
     protocol.FrameError),
    (record.decode, VALID_REC, msgpack.packb([True, *msgpack.unpackb(VALID_REC)[1:]], use_bin_type=True),
     record.RecordError),
], ids=["provider-step-bool", "provider-members-str", "provider-addrs-str", "report-step-bool", "state-loss-str",
        "state-addrs-str", "chunks-version-bool", "dht-request-id-bool", "dht-request-method-list",
        "dht-reply-id-bool", "dht-record-version-bool"])
def test_decoders_refuse_a_field_of_the_wrong_type(decoder, good, bad, error):
    decoder(good)  # the well-typed original decodes
    with pytest.raises(error):
        decoder(bad)


def test_presence_and_roster_confirmations_of_loose_types_are_dropped():
    assert codecs.decode_presence(VALID_PRESENCE)["role"] == "trainer"
    with pytest.raises(codecs.RecordError):  # was role "5"
        codecs.decode_presence(msgpack.packb({"addrs": [ADDR], "role": 5}))
    with pytest.raises(codecs.RecordError):
        codecs.decode_presence(msgpack.packb({"addrs": [ADDR], "conns": "direct"}))
    view = [ID_A.peer_id_str, ID_B.peer_id_str]
    from p2ptrain.run import election

    rh = election.roster_hash("run", 3, 0, view)
    ok = roster_codec.Confirm(rh, "ab" * 32, 16 * 4096 + 2, tuple(view)).encode()
    assert roster_codec.decode(ok, "run", 3, 0) is not None
    for chunk in ("+65538", " 65538", "65_538", "６５５３８"):  # int() took each of them
        assert roster_codec.decode(ok.replace(b"/65538/", f"/{chunk}/".encode()), "run", 3, 0) is None, chunk


def test_sparse_headers_signed_with_step_true_do_not_match_step_1():
    from p2ptrain.reduce import sparsecodec

    cfg = sparsecodec.SparseConfig()
    n, payload = 4096, b""
    body = sparsecodec._body("run", True, 0, "r", ID_A.peer_id_str, n, cfg, payload)
    header = msgpack.packb({"h": body, "sig": ID_A.sign(sparsecodec._DOMAIN + msgpack.packb(body))}, use_bin_type=True)
    with pytest.raises(sparsecodec.BadSparse, match="wrong-step"):
        sparsecodec.verify(ID_A.peer_id_str, header, [], "run", 1, 0, "r", n, cfg)


# -- peer-chosen text in logs (issue 32) ---------------------------------------------------
@FUZZ
@given(st.text(max_size=600), st.integers(1, 300))
def test_clean_text_is_one_bounded_line(text, limit):
    out = clean(text, limit)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029" for c in out)
    assert len(out) <= 4 * limit + 20  # each kept character escapes to at most 6, "...(+n)" after
    if text.isprintable() and len(text) <= limit:
        assert out == text


def test_a_peers_reason_cannot_forge_a_log_line(caplog):
    """An abort vote's reason with a newline: before, it reached the round's blame and every
    log line that printed it as two lines (the second forged: "... INFO round committed")."""
    import io
    import logging

    evil = "bad norm\n12:00:00 I p2ptrain: outer_step_committed step=9\x1b[2K"
    vote = commit_codec._parse_vote({"ok": False, "digest": "", "blame": ID_B.peer_id_str, "reason": evil})
    assert "\n" not in vote["reason"] and "\x1b" not in vote["reason"] and "\\x0a" in vote["reason"]
    with pytest.raises(ValueError):  # a reason of another type is malformed, not str()-ed
        commit_codec._parse_vote({"ok": False, "digest": "", "blame": "", "reason": ["a", "b"]})
    # Whatever a caller logs, the installed formatter writes one line per record.
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(SafeFormatter("%(levelname).1s %(name)s: %(message)s"))
    logger = logging.getLogger("p2ptrain.test.safe")
    logger.addHandler(handler)
    try:
        logger.warning("contribution rejected: reason=%s", evil)
    finally:
        logger.removeHandler(handler)
    assert out.getvalue().count("\n") == 1 and "\\x0a12:00:00" in out.getvalue()
    # Text events: each field escaped too (round_failed is a DEBUG line in human mode: issue 33).
    caplog.set_level(logging.DEBUG, logger="p2ptrain")
    EventSink(ID_A.peer_id_str, json_mode=False).emit("round_failed", blamed={ID_B.peer_id_str: evil})
    msgs = [r.getMessage() for r in caplog.records if "round_failed" in r.getMessage()]
    assert msgs and all("\n" not in m and "\x1b" not in m for m in msgs), msgs
