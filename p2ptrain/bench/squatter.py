"""Hostile record writers and requesters for `bench redteam` (issue 32):
`python -m p2ptrain.bench.squatter MODE --run RUN --bootstrap ADDR`.

Real libp2p, its own process, identities that cost nothing to make; it trains nothing. It
follows the run's step from the ready records honest peers publish (`ready/<t>`), and:
  expiry      re-stores a ready record for the current and the next step (from before the
              run's first step) every 5 s with an 8 s expiry and a ready time 10 minutes early (the simulator's `expiry`
              attack, `p2ptrain.sim.world`); it serves no rounds, so a group that elects
              it waits for a member that never confirms
  eclipse     stores, from 5 identities each, ~60 KiB records under the next 3 `ready/<t>`
              keys before honest peers publish there (issue 32 item 2: replies cut at
              256 KiB in insertion order hid every honest ready record)
  provider    copies the newest honest provider record under 2 identities whose peer ids
              sort before every honest one, each on its own host that accepts the fetch
              stream and never answers (item 3: each held a manifest fetch for 60 s)
  slot        one identity opens 8 requests for the newest checkpoint's chunk manifest to
              every donor, reads each at 1 KiB/s, and opens another when one ends (item 5:
              one identity held every serving slot of a donor)
  reputation  2 identities publish reputation reports naming every honest peer at the
              current step, refreshed every 5 s (item 6: robust runs only read them)
Prints an `attacker_<mode>` JSON line every 10 s (what it managed, what was refused) and
stays up until killed. `--ready-file` is written once it is in place (the bench starts a
late honest joiner then, for the attacks on newcomers: provider, slot).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODES = ("expiry", "eclipse", "provider", "slot", "reputation")
EARLY = 600.0
"""How far before now the expiry attacker claims to have been ready (seconds)."""


async def current_step(dht, run_id: str, known: int) -> int:
    """The highest step with ready records, searched from `known` (the last one found, -1:
    none yet) a few steps on; `known` again when none is found there."""
    from p2ptrain.records import keys

    for t in range(max(0, known), max(0, known) + 4):
        if await dht.get(keys.ready(run_id, t)):
            break
    else:
        return known
    while await dht.get(keys.ready(run_id, t + 1)):
        t += 1
    return t


async def newest_providers(dht, run_id: str, skip: set[str]) -> list:
    """The provider records (not signed by `skip`) of the newest step any of them names."""
    from p2ptrain.records import codecs
    from p2ptrain.identity import peer_id_to_str
    from p2ptrain.records import keys

    got = []
    for sub, rec in (await dht.get(keys.providers(run_id))).items():
        peer = peer_id_to_str(sub)
        if peer in skip:
            continue
        try:
            got.append(codecs.decode_provider(peer, rec.value))
        except codecs.RecordError:
            continue
    top = max((p.step for p in got), default=-1)
    return [p for p in got if p.step == top]


def first_sorting(n: int, pool: int = 256) -> list:
    """`n` fresh identities whose peer ids sort first among `pool` fresh ones (and so, with
    high odds, before every honest peer's)."""
    from p2ptrain.identity import Identity

    return sorted((Identity.generate() for _ in range(pool)), key=lambda i: i.peer_id_str)[:n]


async def _store(dht, rec, out: dict) -> None:
    """Store a record we signed (any identity); a refusal is the defence working: counted."""
    try:
        acked = await dht.store_record(rec)
    except Exception as exc:
        out["refused"] = out.get("refused", 0) + 1
        out["last_error"] = str(exc)[:120]
        return
    out["stored" if acked else "refused"] = out.get("stored" if acked else "refused", 0) + 1


async def expiry_once(dht, run_id: str, t: int, addrs: list[str], out: dict) -> None:
    """Our ready record for steps t and t+1 (0 and 1 before the run starts): 10 minutes
    early, expiring in 8 s."""
    from p2ptrain.clock import wall_time
    from p2ptrain.dht.record import make_record
    from p2ptrain.records import codecs, keys

    value = codecs.encode_ready(wall_time() - EARLY, addrs, False)
    for s in (max(t, 0), max(t, 0) + 1):
        await _store(dht, make_record(dht.identity, keys.ready(run_id, s), value, wall_time() + 8), out)


async def eclipse_once(dht, run_id: str, t: int, fakes: list, done: set[int], out: dict) -> None:
    """~60 KiB records from each of `fakes` under ready/<t+1..t+3> (each key once)."""
    from p2ptrain.clock import wall_time
    from p2ptrain.dht.record import make_record
    from p2ptrain.records import keys

    for s in range(t + 1, t + 4):
        if s in done:
            continue
        done.add(s)
        for ident in fakes:
            await _store(dht, make_record(ident, keys.ready(run_id, s), _big(s), wall_time() + 60), out)


async def reputation_once(dht, run_id: str, t: int, fakes: list, out: dict) -> None:
    """Each of `fakes` reports every writer of step t's ready records (but themselves)."""
    from p2ptrain.clock import wall_time
    from p2ptrain.dht.record import make_record
    from p2ptrain.records import codecs, keys

    mine = {i.peer_id_str for i in fakes} | {dht.identity.peer_id_str}
    honest = [p for p in await _writers(dht, run_id, t) if p not in mine]
    value = codecs.encode_report({p: t for p in honest})
    for ident in fakes:
        await _store(dht, make_record(ident, keys.reputation(run_id), value, wall_time() + 600), out)
    out["named"] = len(honest)


async def copy_provider(dht, run_id: str, p, fakes: list, addrs: list[list[str]], out: dict) -> None:
    """Provider record `p` re-signed by each of `fakes`, naming its own (silent) address."""
    from p2ptrain.records import codecs
    from p2ptrain.clock import wall_time
    from p2ptrain.dht.record import make_record
    from p2ptrain.records import keys

    for ident, a in zip(fakes, addrs):
        value = codecs.encode_provider(p.step, p.manifest, p.sha256, p.params, list(p.members), a)
        await _store(dht, make_record(ident, keys.providers(run_id), value, wall_time() + 600), out)
    out["copied_step"] = p.step


async def attack(args) -> None:
    import trio

    from p2ptrain.events import EventSink
    from p2ptrain.identity import Identity
    from p2ptrain.net.node import Node, NodeConfig

    def node_for(ident):
        return Node(ident, NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[args.bootstrap]),
                    EventSink(ident.peer_id_str, False))

    out: dict = {"mode": args.mode, "step": -1, "stored": 0, "refused": 0}
    said = [trio.current_time()]
    placed = [False]

    def in_place() -> None:
        if not placed[0]:
            if args.ready_file:
                Path(args.ready_file).write_text("ready\n")
            said[0] = -1e9  # say what it did at once: a short run may end before the next report
        placed[0] = True

    main = node_for(Identity.generate())
    async with trio.open_nursery() as nursery:
        await nursery.start(main.run)
        dht = main.dht
        nodes = []
        if args.mode == "provider":
            fakes = first_sorting(2)
            nodes = [node_for(i) for i in fakes]
            for n in nodes:
                await nursery.start(n.run)
                n.host.set_stream_handler(_fetch_protocol(), _never_answer)
            out["sybils"] = [i.peer_id_str for i in fakes]
        else:
            fakes = [Identity.generate() for _ in range(5 if args.mode == "eclipse" else 2)]
        done: set[int] = set()
        copied, hog = -1, None
        while True:
            with trio.move_on_after(15):
                t = out["step"] = await current_step(dht, args.run, out["step"])
                if args.mode == "expiry":
                    await expiry_once(dht, args.run, t, main.rpc.local_addrs(), out)
                    in_place()
                elif args.mode == "eclipse":
                    await eclipse_once(dht, args.run, t, fakes, done, out)
                    in_place()
                elif args.mode == "reputation" and t >= 0:
                    await reputation_once(dht, args.run, t, fakes, out)
                    in_place()
                elif args.mode in ("provider", "slot"):
                    donors = await newest_providers(dht, args.run, set(out.get("sybils", ())))
                    if donors and donors[0].step > copied:
                        copied = donors[0].step
                        if args.mode == "provider":
                            await copy_provider(dht, args.run, donors[0], fakes, [n.rpc.local_addrs() for n in nodes],
                                                out)
                        else:
                            if hog is not None:  # the newest checkpoint is what newcomers fetch
                                hog.cancel()
                            out.setdefault("opened", 0)
                            out.setdefault("ended", 0)
                            hog = await nursery.start(_hog, main, donors, out)
                            out["hogging_step"] = copied
                        in_place()
            if trio.current_time() - said[0] >= 10:
                said[0] = trio.current_time()
                print(json.dumps({"event": f"attacker_{args.mode}", **out}), flush=True)
            await trio.sleep(5.0 if args.mode in ("expiry", "reputation") else 2.0)


def _big(step: int) -> bytes:
    return step.to_bytes(8, "big") + b"\xee" * (60 * 1024 - 8)


async def _writers(dht, run_id: str, t: int) -> list[str]:
    from p2ptrain.identity import peer_id_to_str
    from p2ptrain.records import keys

    return sorted(peer_id_to_str(s) for s in await dht.get(keys.ready(run_id, t)))


def _fetch_protocol():
    from p2ptrain.ckpt.fetch import PROTOCOL

    return PROTOCOL


async def _never_answer(stream) -> None:
    """Accepts the request and serves nothing (bounded: the fetcher gives up long before)."""
    import trio

    with trio.move_on_after(600):
        await trio.sleep_forever()


async def _hog(node, donors: list, out: dict, per_donor: int = 8, task_status=None) -> None:
    """Hold `per_donor` slow requests for the chunk manifest at every provider in `donors`
    (one step's records), each read at 1 KiB/s; reopen each as it ends (until cancelled)."""
    import msgpack
    import trio
    from libp2p.peer.id import ID

    from p2ptrain.identity import peer_id_from_str

    async def one(peer: bytes, manifest: str) -> None:
        while True:
            try:
                with trio.fail_after(600):
                    stream = await node.host.new_stream(ID(peer), [_fetch_protocol()])
                    req = msgpack.packb({"sha256": manifest})
                    await stream.write(len(req).to_bytes(2, "big") + req)
                    out["opened"] += 1
                    while await stream.read(1024):
                        await trio.sleep(1.0)
            except (Exception, trio.TooSlowError):
                out["refused"] += 1
                await trio.sleep(1.0)
            out["ended"] += 1

    async with trio.open_nursery() as nursery:
        task_status.started(nursery.cancel_scope)
        for p in donors:
            node.rpc.learn_addrs(peer_id_from_str(p.peer), list(p.addrs))
            for _ in range(per_donor):
                nursery.start_soon(one, peer_id_from_str(p.peer), p.manifest)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m p2ptrain.bench.squatter")
    p.add_argument("mode", choices=MODES)
    p.add_argument("--run", required=True, help="run id")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--ready-file", help="written once the attack is in place")
    args = p.parse_args(argv)
    import trio

    try:
        trio.run(attack, args)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
