"""`p2ptrain bench readpause`: what a receiver that holds back its reads costs the link.

A verified ring round cannot mix in a frame before the members' signed headers are in, and
its first ~20-35 ms pass waiting for them while the predecessor's own chunk keeps arriving
(`ring._RingRound.read_ahead`). This bench isolates what the receiver's reading during that
wait does to TCP, with the product's own frames (`FrameChannel` over `SocketIO`: AES-GCM,
8 MiB socket buffers) on one shaped link of the emulated internet (`bench.inetlab`). Per
round the sender sends `--frames` ring-sized frames (1 MiB of int8 values each) after the
receiver's go, and the receiver either
  - plain: reads every frame as it comes (the unverified ring; the reference),
  - whole: for the first `--hold-ms`, reads a frame only once the kernel holds all of it
    (what read-ahead did before this bench),
  - pull: for the first `--hold-ms`, takes whatever bytes have come every 0.5 ms
    (`FrameChannel.pull`: read-ahead now),
then reads the rest in turn. A round's time is the receiver's, from its go to the last
frame; each mode's median is compared with plain's, in the same run (modes interleave, so
load drifts hit all three).
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time

MODES = ("plain", "whole", "pull")


def add_arguments(p) -> None:
    p.add_argument("--mbit", type=float, default=1000.0, help="the link's rate (default 1000)")
    p.add_argument("--hold-ms", type=float, default=30.0, help="how long reads are held back (default 30)")
    p.add_argument("--frames", type=int, default=10, help="frames per round (default 10)")
    p.add_argument("--rounds", type=int, default=6, help="rounds per mode (default 6)")
    p.add_argument("--json", action="store_true", help="JSON lines; the last is the summary")


def _channel(sock: socket.socket, role: str):
    from p2ptrain.reduce.bulk import FrameChannel, SocketIO, derive_key

    key = derive_key(b"b" * 32, b"send", b"recv", b"readpaus")
    return FrameChannel(SocketIO(sock, 30.0), key, b"readpaus", role)


def _frame_bytes() -> int:
    from p2ptrain.reduce.schedule import RingConfig, wire_bytes

    return wire_bytes(1 << 20, RingConfig())


def _receiver(ip: str, modes: list[str], hold_s: float, frames: int) -> None:
    from p2ptrain.reduce.bulk import HEADER, TAG
    from p2ptrain.reduce.ring import FrameId

    srv = socket.create_server((ip, 0))
    print(srv.getsockname()[1], flush=True)
    srv.settimeout(30)
    sock, _ = srv.accept()
    ch, out = _channel(sock, "recv"), memoryview(bytearray(_frame_bytes()))
    for r, mode in enumerate(modes):
        time.sleep(0.3)  # idle between rounds, as between all-reduces
        t0 = time.monotonic()
        sock.sendall(b"g")
        k, until = 0, t0 + hold_s
        while mode != "plain" and k < frames and time.monotonic() < until:
            fid = FrameId(r, k)
            if mode == "pull":
                got = ch.pull(fid, out)
            else:
                whole = ch.io.available() >= HEADER.size + len(out) + TAG  # all of it in the kernel
                got = ch.recv(fid, out) if whole else None
            if got is None:
                time.sleep(0.0005 if mode == "pull" else 0.001)
            else:
                k += 1
        for j in range(k, frames):
            ch.recv(FrameId(r, j), out)
        print(json.dumps({"mode": mode, "seconds": time.monotonic() - t0}), flush=True)
    sock.close()


def _sender(ip: str, port: int, rounds: int, frames: int) -> None:
    from p2ptrain.reduce.ring import FrameId

    sock = socket.create_connection((ip, port), timeout=30)
    ch, payload = _channel(sock, "send"), memoryview(bytes(_frame_bytes()))
    for r in range(rounds):
        if sock.recv(1) != b"g":
            return
        for j in range(frames):
            ch.send(FrameId(r, j), payload)
    time.sleep(0.5)  # what we sent is delivered before the close
    sock.close()


def measure(mbit: float, hold_ms: float, frames: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per round, by mode, on one shaped link (raises LabUnavailable where no lab)."""
    from p2ptrain.bench.inetlab import internet_lab

    modes = [MODES[i % len(MODES)] for i in range(len(MODES) * (rounds + 1))]  # a warm-up each
    me = [sys.executable, "-m", "p2ptrain.bench.readpause"]
    with internet_lab([mbit, mbit], boot=False) as lab:
        recv = subprocess.Popen([*lab.prefix(1), *me, "--role", "recv", lab.ip(1), ",".join(modes),
                                 str(hold_ms / 1000), str(frames)], stdout=subprocess.PIPE, text=True)
        try:
            port = recv.stdout.readline().strip()
            if not port.isdigit():
                raise RuntimeError("readpause: the receiver did not start")
            subprocess.run([*lab.prefix(0), *me, "--role", "send", lab.ip(1), port, str(len(modes)), str(frames)],
                           check=True, timeout=60 + 2 * len(modes))
            lines = recv.communicate(timeout=60)[0].splitlines()
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait(5)
    got = [json.loads(x) for x in lines]
    if len(got) != len(modes):
        raise RuntimeError(f"readpause: {len(got)} of {len(modes)} rounds reported")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for g in got[len(MODES):]:
        times[g["mode"]].append(g["seconds"])
    return times


def run(args) -> int:
    from p2ptrain.bench.inetlab import LabUnavailable

    if args.frames < 3 or args.rounds < 1 or args.hold_ms < 0 or args.mbit <= 0:
        print("error: --frames must be >= 3, --rounds >= 1, --hold-ms >= 0 and --mbit > 0")
        return 2
    try:
        times = measure(args.mbit, args.hold_ms, args.frames, args.rounds)
    except LabUnavailable as exc:
        print(f"error: the emulated internet is not available here: {exc}")
        return 2
    med = {m: statistics.median(v) for m, v in times.items()}
    wire = args.frames * (_frame_bytes() + 48) * 8 / (args.mbit * 1e6)
    rows = [{"event": "bench_readpause_row", "mode": m, "median_s": round(med[m], 4),
             "vs_plain": round(med[m] / med["plain"], 3), "seconds": [round(x, 4) for x in times[m]]}
            for m in MODES]
    summary = {"event": "bench_readpause_summary", "link_mbit": args.mbit, "hold_ms": args.hold_ms,
               "frames": args.frames, "rounds": args.rounds, "wire_bound_s": round(wire, 4),
               "extra_ms_whole": round(1e3 * (med["whole"] - med["plain"]), 2),
               "extra_ms_pull": round(1e3 * (med["pull"] - med["plain"]), 2)}
    for r in (*rows, summary):
        print(json.dumps(r) if args.json else " ".join(f"{k}={v}" for k, v in r.items() if k != "event"))
    return 0


def _role_main(argv: list[str]) -> int:
    if argv[0] == "recv":
        _receiver(argv[1], argv[2].split(","), float(argv[3]), int(argv[4]))
    else:
        _sender(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        sys.exit(_role_main(sys.argv[2:]))
    sys.exit("usage: p2ptrain bench readpause [--mbit M] [--hold-ms MS] [--frames N] [--rounds R] [--json]")
