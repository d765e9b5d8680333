"""Progress for inner steps and checkpoint downloads: a bar on a terminal, log lines
otherwise; and a real download over libp2p reporting its bytes (plus the kind of the
connection it used)."""

from __future__ import annotations

import io
import logging
import os

import multiaddr
import trio

from p2ptrain.net.connkinds import connection_kinds, kind_counts
from p2ptrain.ckpt.download import CheckpointServer, download as chunked_download
from p2ptrain.ckpt.fetch import BlobServer
from p2ptrain.ckpt.providers import Choice
from p2ptrain.identity import Identity
from p2ptrain.net.node import NodeConfig, build_host
from p2ptrain.train.progress import Progress, download, make


def test_bar_on_a_terminal():
    out = io.StringIO()
    p = Progress("outer step 3", "inner steps", tty=True, out=out)
    for i in range(1, 21):
        p(i, 20)
    text = out.getvalue()
    assert text.startswith("\r\x1b[Kouter step 3: [") and text.endswith("] 20/20 inner steps\n")
    assert "#" * 30 in text and text.count("\n") == 1


def test_log_lines_when_not_a_terminal(caplog):
    caplog.set_level(logging.INFO, logger="p2ptrain.train.progress")
    p = Progress("outer step 0", "inner steps", tty=False, out=io.StringIO())
    for i in range(1, 101):
        p(i, 100)
    lines = [r.getMessage() for r in caplog.records if r.name == "p2ptrain.train.progress"]
    assert len(lines) == 4 and lines[-1] == "outer step 0: 100/100 inner steps (100%)"
    for n, line in zip((25, 50, 75), lines):  # and the time left in the phase, from its own rate
        assert line.startswith(f"outer step 0: {n}/100 inner steps ({n}%), ") and line.endswith("s left"), line
    assert make("x", json_mode=True) is None and download("x", json_mode=True) is None


def test_download_reports_progress_over_real_libp2p(caplog):
    caplog.set_level(logging.INFO, logger="p2ptrain.train.progress")
    blob = os.urandom(3_500_000)
    out = io.StringIO()
    seen: dict = {}

    async def main() -> None:
        from libp2p.peer.peerinfo import PeerInfo

        cfg = NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"])
        server, client = build_host(Identity.generate(), cfg), build_host(Identity.generate(), cfg)
        addr = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]
        async with server.run(addr), client.run(addr):
            blobs = BlobServer(server)
            m, manifest_digest = CheckpointServer(blobs, 256 << 10).serve(blob)
            choice = Choice(1, manifest_digest, m.sha256, "00" * 32, (str(server.get_id()),), ())
            with trio.fail_after(30):
                await client.connect(PeerInfo(server.get_id(), server.get_addrs()))
                bar = Progress("checkpoint", show=lambda n: f"{n / 1e6:.1f} MB", tty=True, out=out)
                seen["bar"], _ = await chunked_download(client, choice, progress=bar)
                seen["log"], _ = await chunked_download(client, choice,
                                                        progress=download("state of step 0", json_mode=False))
            seen["kinds"] = connection_kinds(client)
            seen["counts"] = kind_counts(client)
            seen["server"] = str(server.get_id())

    trio.run(main)
    assert seen["bar"] == blob and seen["log"] == blob
    assert out.getvalue().endswith("] 3.5 MB/3.5 MB\n")
    lines = [r.getMessage() for r in caplog.records if r.name == "p2ptrain.train.progress"]
    assert len(lines) == 4 and lines[-1] == "state of step 0: 3.5 MB/3.5 MB (100%)", lines
    assert seen["kinds"] == {seen["server"]: "direct"} and seen["counts"] == {"direct": 1}
