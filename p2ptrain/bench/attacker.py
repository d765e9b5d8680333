"""A hostile peer for the resource-limit tests (`python -m p2ptrain.bench.attacker MODE ...`).

Real libp2p, its own process, a fresh identity each run. Modes:
  streams    open COUNT streams to TARGET (our DHT protocol) at once and hold them, each
             claiming a 400 KiB frame it never sends (ties up handler tasks and pending bytes);
  dht-flood  join the DHT through BOOTSTRAP and send signed-record store requests as fast as
             possible to every node it learns, from WRITERS identities (so the per-writer cap
             alone cannot stop it);
  garbage    join the DHT through BOOTSTRAP and send COUNT streams of random or malformed
             bytes, spread over SECONDS, on every run protocol (DHT, round/vote, bulk session,
             blob fetch, NAT probe) to every peer it learns (`p2ptrain bench redteam`).
Prints one JSON line at the end: what it managed and what was refused.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


async def streams(target: str, count: int, seconds: float) -> dict:
    import trio
    from libp2p.peer.id import ID

    from p2ptrain.dht.libp2p_rpc import PROTOCOL_ID
    from p2ptrain.identity import Identity
    from p2ptrain.net.node import NodeConfig, build_host, parse_maddr, parse_peer_maddr

    pid, addr = parse_peer_maddr(target)
    host = build_host(Identity.generate(), NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"]))
    out = {"opened": 0, "refused": 0, "reset_later": 0, "reconnects": 0}
    held = []
    async with host.run([parse_maddr("/ip4/127.0.0.1/tcp/0")]):
        from p2ptrain.dht.libp2p_rpc import Libp2pRpc

        rpc = Libp2pRpc(host)
        await rpc.connect(pid, [addr], 10)

        async def one() -> None:
            try:
                with trio.fail_after(15):
                    s = await host.new_stream(ID(pid), [PROTOCOL_ID])
                    await s.write((400 * 1024).to_bytes(4, "big") + b"\x00" * 64)
                out["opened"] += 1
                held.append(s)
            except (Exception, trio.TooSlowError):
                out["refused"] += 1

        with trio.move_on_after(seconds):
            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    nursery.start_soon(one)
            # Keep coming back while the time lasts: a banned peer's new streams are refused.
            while True:
                await trio.sleep(1.0)
                if not host.get_network().get_connections(ID(pid)):
                    out["reconnects"] += 1
                    try:
                        await rpc.connect(pid, [addr], 5)
                    except (Exception, trio.TooSlowError):
                        continue
                async with trio.open_nursery() as nursery:
                    for _ in range(50):
                        nursery.start_soon(one)
        out["connected_at_end"] = bool(host.get_network().get_connections(ID(pid)))
    return out


async def dht_flood(bootstrap: str, writers: int, seconds: float) -> dict:
    import trio

    from p2ptrain.clock import wall_time
    from p2ptrain.dht.record import make_record
    from p2ptrain.dht.transport import RpcError
    from p2ptrain.events import EventSink
    from p2ptrain.identity import Identity
    from p2ptrain.net.node import Node, NodeConfig

    me = Identity.generate()
    ids = [Identity.generate() for _ in range(writers)]
    node = Node(me, NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[bootstrap]), EventSink("x", False))
    out = {"sent": 0, "stored": 0, "refused": {}, "errors": 0, "targets": 0}
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        await node.dht.refresh()
        targets = [p for p in node.dht.routing.closest(node.dht.routing.local_id, 64)]
        out["targets"] = len(targets)
        # Signed once, sent over and over: the attacker spends its CPU on sending, so the
        # victims' step times measure their defence, not a CPU-hungry neighbour.
        pool = [make_record(ids[i % len(ids)], f"/p2ptrain/flood/{i}", b"x" * 512, wall_time() + 3600).encode()
                for i in range(4096)]
        i = 0

        async def flood(peer: bytes) -> None:
            nonlocal i
            while True:
                batch = [pool[(i + k) % len(pool)] for k in range(16)]
                i += 16
                out["sent"] += len(batch)
                try:
                    reply = await node.dht._call(peer, "store", {"records": batch})
                except RpcError as exc:
                    reason = "rate-limited" if "rate-limited" in str(exc) else "error"
                    out["refused"][reason] = out["refused"].get(reason, 0) + len(batch)
                    await trio.sleep(0.05 if reason == "error" else 0)
                    continue
                for r in reply.get("results", []):
                    if r == "ok":
                        out["stored"] += 1
                    else:
                        out["refused"][r] = out["refused"].get(r, 0) + 1

        with trio.move_on_after(seconds):
            async with trio.open_nursery() as inner:
                for peer in targets:
                    inner.start_soon(flood, peer)
        nursery.cancel_scope.cancel()
    return out


def garbage_payload(rng, kind: int) -> bytes:
    """One hostile message: raw noise, a length prefix claiming 2 GiB, a true length with a
    noise body, or well-framed msgpack with wrong fields (a vote with a random signature, a
    data message for a random tag, a certificate request, a list instead of a map)."""
    from p2ptrain.reduce.control import pack

    noise = rng.bytes(int(rng.integers(1, 4096)))
    tag = rng.bytes(32)
    return [noise,
            (2 ** 31).to_bytes(4, "big") + noise[:64],
            len(noise).to_bytes(4, "big") + noise,
            pack({"tag": tag, "kind": "vote", "ok": True, "digest": rng.bytes(32).hex(), "sig": rng.bytes(64),
                  "blame": "", "reason": ""}),
            pack({"tag": tag, "kind": "data", "data": rng.bytes(2000)}),
            pack({"tag": tag, "kind": "certq"}),
            pack([1, 2, 3]),
            ][kind % 7]


async def garbage(bootstrap: str, count: int, seconds: float) -> dict:
    import numpy as np
    import trio
    from libp2p.peer.id import ID

    from p2ptrain.ckpt.fetch import PROTOCOL as FETCH
    from p2ptrain.dht.libp2p_rpc import PROTOCOL_ID as DHT
    from p2ptrain.events import EventSink
    from p2ptrain.identity import Identity
    from p2ptrain.net.natprobe import PROTOCOL as NAT
    from p2ptrain.net.node import Node, NodeConfig
    from p2ptrain.reduce.ctlstreams import CONTROL_PROTOCOL
    from p2ptrain.reduce.service import BULK_PROTOCOL, VOTE_PROTOCOL

    protocols = [DHT, VOTE_PROTOCOL, CONTROL_PROTOCOL, BULK_PROTOCOL, FETCH, NAT]
    me = Identity.generate()
    node = Node(me, NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[bootstrap]), EventSink("x", False))
    rng = np.random.default_rng()
    out = {"sent": 0, "refused": 0, "targets": 0, "by_protocol": {str(p): 0 for p in protocols}}
    async with trio.open_nursery() as nursery:
        await nursery.start(node.run)
        deadline = trio.current_time() + seconds
        gap = seconds / max(1, count)
        seen: set[bytes] = set()
        i = 0
        while i < count and trio.current_time() < deadline:
            if i % 25 == 0:  # learn peers that joined since (honest peers start as we do)
                with trio.move_on_after(5):
                    await node.dht.refresh()
                seen.update(node.dht.routing.closest(node.dht.routing.local_id, 64))
            targets = sorted(seen - {me.peer_id})
            if not targets:
                await trio.sleep(0.5)
                continue
            peer, proto = targets[i % len(targets)], protocols[(i // len(targets)) % len(protocols)]
            try:
                with trio.fail_after(3):
                    stream = await node.host.new_stream(ID(peer), [proto])
                    await stream.write(garbage_payload(rng, int(rng.integers(0, 7))))
                    await stream.close()
                out["sent"] += 1
                out["by_protocol"][str(proto)] += 1
            except (Exception, trio.TooSlowError):
                out["refused"] += 1
            i += 1
            if i % 25 == 0:  # the bench may stop us when the honest run ends: report as we go
                print(json.dumps({"event": "attacker_garbage", **out, "targets": len(seen)}), flush=True)
            await trio.sleep(gap)
        out["targets"] = len(seen)
        nursery.cancel_scope.cancel()
    return out


def main(argv: list[str] | None = None) -> int:
    import trio

    p = argparse.ArgumentParser(prog="python -m p2ptrain.bench.attacker")
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("streams")
    s.add_argument("--target", required=True, help="/ip4/.../tcp/.../p2p/<id> of the victim")
    s.add_argument("--count", type=int, default=1000)
    s.add_argument("--seconds", type=float, default=30.0)
    f = sub.add_parser("dht-flood")
    f.add_argument("--bootstrap", required=True)
    f.add_argument("--writers", type=int, default=20)
    f.add_argument("--seconds", type=float, default=30.0)
    g = sub.add_parser("garbage")
    g.add_argument("--bootstrap", required=True)
    g.add_argument("--count", type=int, default=400, help="streams in all")
    g.add_argument("--seconds", type=float, default=20.0)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    if args.mode == "streams":
        out = trio.run(streams, args.target, args.count, args.seconds)
    elif args.mode == "garbage":
        out = trio.run(garbage, args.bootstrap, args.count, args.seconds)
    else:
        out = trio.run(dht_flood, args.bootstrap, args.writers, args.seconds)
    out.update(event=f"attacker_{args.mode.replace('-', '_')}", seconds=round(time.monotonic() - t0, 1))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
