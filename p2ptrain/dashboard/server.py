"""The dashboard's HTTP side: a stdlib threaded HTTP server next to the node's trio loop.

Routes: `/` and `/static/*` (the page, shipped as package data, nothing from the internet),
`/api/state` (one JSON snapshot), `/events` (server-sent events: a snapshot whenever it
changes) and `/metrics` (Prometheus text). The trio side feeds a `Hub` from the node's
EventSink and polls the host and the DHT; HTTP threads only read the hub under its lock.

Every request must name an allowed Host (`host_allowed`), else it gets 403: through DNS
rebinding a web page the user visits can point its own host name at 127.0.0.1 and read the
dashboard as same-origin; the browser still sends that name as Host.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

import trio

from p2ptrain.net.connkinds import connection_kinds
from p2ptrain.dashboard.state import DashboardState
from p2ptrain.events import EventSink
from p2ptrain.net.node import NodeError

log = logging.getLogger("p2ptrain.dashboard")
STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}
MAX_SSE_CLIENTS = 16


@dataclass
class DashboardConfig:
    listen: str = "127.0.0.1:8080"
    """HOST:PORT to serve on; port 0 picks a free port. Keep it on 127.0.0.1 unless the
    machine's network is trusted: the page shows peer ids and addresses."""
    poll_interval: float = 2.0
    """Seconds between polls of the node's connections; DHT records every second poll."""
    heartbeat: float = 15.0
    """Seconds between SSE keep-alive comments on an idle stream."""
    allowed_hosts: tuple = ()
    """Host names (besides localhost, the listen address and any IP literal) the page may be
    reached by, e.g. the machine's name on a trusted network."""

    def __post_init__(self) -> None:
        parse_listen(self.listen)
        if self.poll_interval <= 0 or self.heartbeat <= 0:
            raise ValueError("poll_interval and heartbeat must be positive")


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"dashboard address {text!r} is not HOST:PORT (e.g. 127.0.0.1:8080)")
    return host.strip("[]"), int(port)


def host_allowed(header: str | None, listen_host: str, extra=()) -> bool:
    """Whether a request's Host header names this dashboard: localhost, an IP literal (a
    rebinding page has a name of its own, never our address), the listen host or a
    configured name. A request without one (not from a browser) is let through."""
    if header is None:
        return True
    host = header.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1:host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    host = host.rstrip(".")
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    names = {"localhost", listen_host.lower().rstrip(".")} | {str(n).lower().rstrip(".") for n in extra}
    return host in names


class Hub:
    """The state plus a condition the SSE threads wait on."""

    def __init__(self, state: DashboardState) -> None:
        self.state = state
        self.cond = threading.Condition()
        self.closing = False

    def on_event(self, ev: dict) -> None:
        with self.cond:
            if self.state.apply(ev):
                self.cond.notify_all()

    def set_network(self, **kw) -> None:
        with self.cond:
            self.state.set_network(**kw)
            self.cond.notify_all()

    def read(self, fn):
        with self.cond:
            return fn(self.state)

    def wait_change(self, version: int, timeout: float) -> int:
        with self.cond:
            self.cond.wait_for(lambda: self.closing or self.state.version != version, timeout)
            return self.state.version

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()


def _handler(hub: Hub, heartbeat: float, sse_slots: threading.Semaphore, listen_host: str = "127.0.0.1",
             allowed_hosts=()):
    static = resources.files("p2ptrain.dashboard") / "static"

    class Handler(BaseHTTPRequestHandler):
        server_version = "p2ptrain-dashboard"

        def log_message(self, fmt, *args) -> None:
            log.debug("http %s " + fmt, self.client_address[0], *args)

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if not host_allowed(self.headers.get("Host"), listen_host, allowed_hosts):
                log.info("dashboard request refused: Host %r is not this dashboard's",
                         str(self.headers.get("Host"))[:100])
                self._send(403, "text/plain", b"host not allowed\n")
                return
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                path = "/static/index.html"
            if path.startswith("/static/") and path[8:] in STATIC:
                name = path[8:]
                self._send(200, STATIC[name], (static / name).read_bytes())
            elif path == "/api/state":
                self._send(200, "application/json", json.dumps(hub.read(DashboardState.snapshot)).encode())
            elif path == "/metrics":
                self._send(200, "text/plain; version=0.0.4; charset=utf-8",
                           hub.read(DashboardState.prometheus).encode())
            elif path == "/events":
                self._events()
            else:
                self._send(404, "text/plain", b"not found\n")

        def _events(self) -> None:
            if not sse_slots.acquire(blocking=False):
                self._send(503, "text/plain", b"too many live dashboards open\n")
                return
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                while not hub.closing:
                    snap, version = hub.read(lambda s: (s.snapshot(), s.version))
                    self.wfile.write(b"data: " + json.dumps(snap).encode() + b"\n\n")
                    self.wfile.flush()
                    while not hub.closing:
                        new = hub.wait_change(version, heartbeat)
                        if new != version:
                            break
                        self.wfile.write(b": keep-alive\n\n")
                        self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the browser went away
            finally:
                sse_slots.release()

    return Handler


class Dashboard:
    """`await nursery.start(dashboard.run)`: serves until cancelled; started() gets the URL."""

    def __init__(self, config: DashboardConfig, events: EventSink, node=None, namespace: str = "",
                 run_id: str = "") -> None:
        self.config = config
        self.events = events
        self.node = node
        self.namespace = namespace
        self.run_id = run_id
        self.hub = Hub(DashboardState(events.peer, run_id))
        if node is not None:
            from p2ptrain.identity import peer_id_to_str
            from p2ptrain.net.node import parse_peer_maddr

            self.hub.state.bootstraps = {peer_id_to_str(parse_peer_maddr(b)[0]) for b in node.config.bootstrap}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        host, port = parse_listen(self.config.listen)
        try:
            server = ThreadingHTTPServer((host, port), _handler(self.hub, self.config.heartbeat,
                                                                threading.Semaphore(MAX_SSE_CLIENTS), host,
                                                                self.config.allowed_hosts))
        except OSError as exc:
            raise NodeError(f"cannot serve the dashboard on {self.config.listen}: {exc.strerror or exc}",
                            "pick another address with --dashboard HOST:PORT") from None
        server.daemon_threads = True
        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("dashboard on %s is reachable from other machines", self.config.listen)
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                  name="dashboard-http", daemon=True)
        for ev in self.events.history:  # what happened before we subscribed
            self.hub.on_event(ev)
        self.events.subscribers.append(self.hub.on_event)
        thread.start()
        bound = server.server_address
        url = f"http://{bound[0]}:{bound[1]}/"
        try:
            self.events.emit("dashboard_listening", url=url)
            task_status.started(url)
            await self._poll()
        finally:
            self.events.subscribers.remove(self.hub.on_event)
            self.hub.close()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await trio.to_thread.run_sync(server.shutdown)
            server.server_close()

    async def _poll(self) -> None:
        from p2ptrain.net.presence import read_peers
        from p2ptrain.run.states import run_states

        tick = 0
        while True:
            node = self.node
            if node is not None and node.host is not None:
                self.hub.set_network(connections=connection_kinds(node.host))
                if node.dht is not None and self.namespace and tick % 2 == 0:
                    try:
                        presence = await read_peers(node.dht, self.namespace)
                        states = await run_states(node.dht, self.run_id) if self.run_id else {}
                    except Exception as exc:  # a DHT hiccup must not take the node down
                        log.info("dashboard: DHT read failed: %s", exc)
                    else:
                        self.hub.set_network(presence=presence, states=states)
                tick += 1
            await trio.sleep(self.config.poll_interval)
