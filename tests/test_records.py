"""A run's DHT records behind one object (p2ptrain.records.RunRecords, issue 30): every record
type round-trips through the in-memory DHT, a hostile entry is dropped without hiding the
others, every refusal is the one RecordError, and the layer imports nothing above it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from conftest import trio_test
from p2ptrain.dht import record as dht_record
from p2ptrain.identity import Identity
from p2ptrain.records import DataRecord, RunRecords, State, codecs, keys
from p2ptrain.records import manifest as mf
from p2ptrain.run import manifest as run_manifest
from test_dht_memory import join_all, make_swarm

ROOT = Path(__file__).resolve().parent.parent
RUN = "ab" * 32
H = [f"{i:x}" * 64 for i in range(1, 5)]
ADDR = "/ip4/127.0.0.1/tcp/9"


def me(node) -> str:
    return node.identity.peer_id_str


@trio_test()
async def test_every_record_type_round_trips_through_the_dht_and_hostile_entries_are_dropped():
    _, nodes = await _swarm(6)
    w, hostile, r = nodes[0], nodes[1], nodes[5]
    mine, theirs = RunRecords(w, RUN), RunRecords(r, RUN)

    await mine.publish_ready(3, 12.5, [ADDR], True, ttl=60)
    await mine.publish_state(State(4, H[0], H[1], 0.5, None, (ADDR,), {"direct": 1}))
    await mine.publish_provider(4, H[0], H[1], H[2], [me(w), me(hostile)], [ADDR])
    await mine.publish_reputation({me(hostile): 4})
    await mine.publish_data(DataRecord(H[0], H[1], "", (ADDR,)))
    await RunRecords(w, "lobby").publish_presence([ADDR], "trainer", {me(hostile): "relayed"}, ttl=60)
    manifest = run_manifest.sign({"name": "tiny", "train": {"group_size": 2}}, w.identity)
    rid = mf.run_id(manifest)
    await RunRecords(w, rid).publish_manifest(manifest)

    # The same keys, each with one malformed value: the reader drops them and keeps ours.
    junk = msgpack.packb({"step": True, "ready_at": "soon", "flagged": [1], "addrs": ADDR, "manifest": 5})
    for key in (keys.ready(RUN, 3), keys.state(RUN), keys.providers(RUN), keys.reputation(RUN), keys.data(RUN),
                keys.presence("lobby"), keys.manifest(rid)):
        assert await hostile.store(key, junk, ttl=60) >= 1

    [(ready, expiry)] = await theirs.read_ready(3)
    assert (ready.peer, ready.ready_at, ready.addrs, ready.joining) == (me(w), 12.5, (ADDR,), True) and expiry > 0
    [(sub, st)] = await theirs.read_states()
    assert sub == w.identity.peer_id and (st.step, st.params, st.ckpt, st.loss, st.conns) == (4, H[0], H[1], 0.5,
                                                                                          {"direct": 1})
    assert (await theirs.state_view())[me(w)]["addrs"] == [ADDR]
    [p] = await theirs.read_providers()
    assert (p.peer, p.step, p.manifest, p.sha256, p.params) == (me(w), 4, H[0], H[1], H[2])
    assert p.members == tuple(sorted([me(w), me(hostile)])) and p.addrs == (ADDR,)
    assert await theirs.read_reputation() == {me(w): {me(hostile): 4}}
    [(sub, d)] = await theirs.read_data()
    assert sub == w.identity.peer_id and d == DataRecord(H[0], H[1], "", (ADDR,))
    assert await RunRecords(r, "lobby").read_presence() == {
        me(w): {"addrs": [ADDR], "role": "trainer", "conns": {me(hostile): "relayed"}, "run": None}}
    got, copies = await RunRecords(r, rid).read_manifest()
    assert got == manifest and copies == 2
    # A valid manifest of another run, served under this run's key, is not this run's.
    assert await RunRecords(r, "cd" * 32).publish_manifest(manifest) >= 1
    assert await RunRecords(r, "cd" * 32).read_manifest() == (None, 1)


async def _swarm(n: int):
    net, nodes = make_swarm(n)
    await join_all(nodes)
    return net, nodes


GOOD = {
    "ready": (lambda v: codecs.decode_ready("p", v), codecs.encode_ready(1.0, [ADDR], False)),
    "state": (codecs.decode_state, codecs.encode_state(State(1, H[0], H[1]))),
    "providers": (lambda v: codecs.decode_provider("p", v), codecs.encode_provider(1, H[0], H[1], H[2], ["p"], [])),
    "reputation": (codecs.decode_report, codecs.encode_report({"p": 1})),
    "data": (codecs.decode_data, codecs.encode_data(DataRecord(H[0], H[1], H[2]))),
    "peers": (codecs.decode_presence, codecs.encode_presence([ADDR], "peer")),
    "manifest": (mf.decode, mf.encode({"name": "x"})),
}
WRONG_TYPE = {
    "ready": {"ready_at": 1.0, "joining": "no"},
    "state": {"step": 1, "params": H[0], "ckpt": H[1], "conns": ["direct"]},
    "providers": {"step": 1, "manifest": H[0], "sha256": H[1], "params": H[2], "members": None},
    "reputation": {"flagged": {"p": 1.5}},
    "data": {"manifest": H[0], "sha256": H[1], "tok": 7},
    "peers": {"addrs": [ADDR], "role": 5},
    "manifest": [1, 2],
}


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_every_refusal_is_the_one_record_error(kind):
    """Oversize (before msgpack sees it), garbage and a field of the wrong type: all refused
    with the DHT layer's RecordError and a reason token, for every record type."""
    decode, good = GOOD[kind]
    decode(good)
    cap = dht_record.KEY_CLASSES[kind].max_record_bytes
    for bad in (b"\x00" * (cap + 1), b"\xc1", msgpack.packb(WRONG_TYPE[kind])):
        with pytest.raises(dht_record.RecordError) as err:
            decode(bad)
        assert err.value.reason in ("oversize", "malformed") or isinstance(err.value, mf.ManifestError)
    assert codecs.RecordError is dht_record.RecordError and issubclass(mf.ManifestError, dht_record.RecordError)


def test_every_record_type_has_a_key_and_each_codec_fits_its_key_class():
    """The largest value each encoder writes decodes, and signed it fits its key class's byte cap."""
    ident = Identity.from_seed(b"\x07" * 32)
    big = [f"/ip4/10.0.0.{i}/tcp/{40000 + i}/p2p/{ident.peer_id_str}" for i in range(40)]
    values = {
        keys.ready(RUN, 1): codecs.encode_ready(1.0, big, False),
        keys.state(RUN): codecs.encode_state(State(1, H[0], H[1], 1.0, 1.0, tuple(big), {"direct": 5})),
        keys.providers(RUN): codecs.encode_provider(1, H[0], H[1], H[2], [ident.peer_id_str] * 64, big),
        keys.reputation(RUN): codecs.encode_report({f"{ident.peer_id_str}{i}": i for i in range(100)}),
        keys.data(RUN): codecs.encode_data(DataRecord(H[0], H[1], H[2], tuple(a[:40] for a in big))),
        keys.presence(RUN): codecs.encode_presence(big, "trainer", {f"{ident.peer_id_str}{i}": "direct"
                                                                   for i in range(40)}),
    }
    decoders = {kind: decode for kind, (decode, _) in GOOD.items()}
    for key, value in values.items():
        decoders[dht_record.key_class(key)](value)  # what the encoder writes, readers accept
        rec = dht_record.make_record(ident, key, value, 1e9)
        assert len(rec.encode()) <= dht_record.KEY_CLASSES[dht_record.key_class(key)].max_record_bytes, key


LOWER = ("p2ptrain/net", "p2ptrain/ckpt", "p2ptrain/records", "dht")


def upward_imports(root: Path) -> list[str]:
    """Imports of p2ptrain.run (or, from the records layer, of anything but the DHT's record
    layer, identity and itself) by modules of the lower layers under `root`."""
    bad = []
    for d in LOWER:
        for path in sorted((root / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                for name in names:
                    up = name == "p2ptrain.run" or name.startswith("p2ptrain.run.")
                    if d == "p2ptrain/records" and name.startswith("p2ptrain"):
                        up = not name.startswith(("p2ptrain.records", "p2ptrain.dht.record", "p2ptrain.identity"))
                    if up:
                        bad.append(f"{path.relative_to(root)}: {name}")
    return bad


def test_net_ckpt_dht_and_the_records_layer_import_nothing_above_them():
    assert upward_imports(ROOT) == []


def test_the_records_layer_loads_neither_trio_libp2p_torch_nor_the_all_reduce(tmp_path):
    code = ("import sys, p2ptrain.records; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('trio', 'libp2p', 'torch', 'numba') or m.startswith(('p2ptrain.reduce', 'p2ptrain.run', "
            "'p2ptrain.net', 'p2ptrain.ckpt', 'p2ptrain.train'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.strip() == "[]", out.stdout
