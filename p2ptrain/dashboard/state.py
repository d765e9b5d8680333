"""What the dashboard shows, built from a node's own events and its view of the network.

Pure logic: no I/O, no trio, no libp2p. The server feeds it events (`apply`) and what the
node polled from its host and the DHT (`set_network`); `snapshot` is the JSON the page
renders, `prometheus` the same figures in Prometheus text format.
"""

from __future__ import annotations

import math
import time
from typing import Any

from p2ptrain.records.keys import MAX_ADDRS

MAX_STEPS = 2000  # curve points kept; a long run shows its most recent part
MAX_REJECTED = 200
MAX_PEERS = 512  # a hostile DHT cannot grow the page without bound


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


class DashboardState:
    def __init__(self, me: str = "", run_id: str = "") -> None:
        self.me = me
        self.run_id = run_id
        self.addrs: list[str] = []
        self.step: int | None = None
        self.phase = "starting"
        self.group: list[str] = []
        self.steps: list[dict] = []
        self.rejected: list[dict] = []
        self.rejected_by_reason: dict[str, int] = {}
        self.skipped = 0
        self.n_params: int | None = None
        self.totals = {"bytes_sent": 0, "bytes_recv": 0, "seconds_inner": 0.0, "seconds_comm": 0.0}
        self.connections: dict[str, str] = {}
        self.presence: dict[str, dict] = {}
        self.states: dict[str, dict] = {}
        self.bootstraps: set[str] = set()
        self.version = 0
        self.started = time.time()

    # -- inputs ----------------------------------------------------------------------
    def apply(self, ev: dict) -> bool:
        """Fold one event in; True when it changed what is shown."""
        kind = ev.get("event")
        if kind == "listening":
            self.me = str(ev.get("peer", self.me))
            self.addrs = [str(a) for a in ev.get("addrs", [])][:MAX_ADDRS]
        elif kind == "run_joined":
            self.run_id = str(ev.get("run", self.run_id))
            self.step, self.n_params = ev.get("step"), ev.get("params")
            self.phase = "joined"
        elif kind == "outer_step_started":
            self.step = ev.get("step")
            self.phase = ("retrying its step: nobody committed it" if ev.get("retry")
                          else "catching up" if ev.get("joining") else "inner steps")
        elif kind == "group_formed":
            self.group = [str(m) for m in ev.get("members", [])]
            self.phase = "all-reduce"
        elif kind == "outer_step_committed":
            self._committed(ev)
        elif kind == "outer_step_skipped":
            self.skipped += 1
            self.phase = f"skipped step {ev.get('step')}: {ev.get('reason', '')}"
        elif kind == "caught_up":
            self.step = ev.get("step")
            self.phase = "caught up"
        elif kind in ("contribution_rejected", "contribution_dropped"):
            reason = ("dropped once: " if kind == "contribution_dropped" else "") + str(ev.get("reason", ""))[:200]
            self.rejected.append({"t": ev.get("t"), "step": ev.get("step"), "remote": str(ev.get("remote", "")),
                                  "reason": reason})
            del self.rejected[:-MAX_REJECTED]
            self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1
        elif kind == "left":
            self.phase = "left"
        else:
            return False
        self.version += 1
        return True

    def _committed(self, ev: dict) -> None:
        row = {"step": ev.get("step"), "t": ev.get("t"), "loss": _num(ev.get("loss")),
               "val_loss": _num(ev.get("val_loss")), "members": len(ev.get("members", []))}
        for k in self.totals:
            v = _num(ev.get(k)) or 0
            row[k] = v
            self.totals[k] += v
        self.steps.append(row)
        del self.steps[:-MAX_STEPS]
        self.step = ev.get("step")
        self.group = [str(m) for m in ev.get("members", self.group)]
        self.phase = "committed"

    def set_network(self, connections: dict[str, str] | None = None, presence: dict[str, dict] | None = None,
                    states: dict[str, dict] | None = None) -> None:
        """What the node polled: connected peer -> kind, presence records, run state records."""
        before = (self.connections, self.presence, self.states)
        if connections is not None:
            self.connections = dict(list(connections.items())[:MAX_PEERS])
        if presence is not None:
            self.presence = dict(list(presence.items())[:MAX_PEERS])
        if states is not None:
            self.states = dict(list(states.items())[:MAX_PEERS])
        if (self.connections, self.presence, self.states) != before:  # live pages redraw only on news
            self.version += 1

    # -- outputs ---------------------------------------------------------------------
    def utilization(self) -> float | None:
        busy = self.totals["seconds_inner"] + self.totals["seconds_comm"]
        return self.totals["seconds_inner"] / busy if busy > 0 else None

    def peers(self) -> list[dict]:
        """Every peer this node knows of: in the run (presence or state record) or connected."""
        out = []
        ids = set(self.connections) | set(self.presence) | set(self.states) | ({self.me} if self.me else set())
        for pid in sorted(ids):
            st, pr = self.states.get(pid, {}), self.presence.get(pid, {})
            role = pr.get("role") or ("trainer" if st else "bootstrap" if pid in self.bootstraps else "")
            out.append({"peer": pid, "self": pid == self.me,
                        "kind": "self" if pid == self.me else self.connections.get(pid, "not connected"),
                        "role": role, "in_run": bool(st or pr),
                        "in_group": pid in self.group, "step": st.get("step"),
                        "loss": _num(st.get("loss")), "val_loss": _num(st.get("val_loss")),
                        "links": st.get("conns") or {}})
        return out[:MAX_PEERS]

    def snapshot(self) -> dict:
        kinds: dict[str, int] = {}
        for k in self.connections.values():
            kinds[k] = kinds.get(k, 0) + 1
        return {"me": self.me, "run": self.run_id, "addrs": self.addrs, "step": self.step, "phase": self.phase,
                "group": self.group, "n_params": self.n_params, "committed": len(self.steps),
                "skipped": self.skipped, "steps": self.steps, "totals": self.totals,
                "utilization": self.utilization(), "connections": kinds, "peers": self.peers(),
                "rejected": self.rejected[-50:], "rejected_total": sum(self.rejected_by_reason.values()),
                "version": self.version, "uptime": round(time.time() - self.started, 1)}

    def prometheus(self) -> str:
        last = self.steps[-1] if self.steps else {}
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[dict, float | None]]) -> None:
            lines.append(f"# HELP p2ptrain_{name} {help_}")
            lines.append(f"# TYPE p2ptrain_{name} {kind}")
            for labels, value in samples:
                if value is None:
                    continue
                lab = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"p2ptrain_{name}{{{lab}}} {_fmt(value)}" if lab else f"p2ptrain_{name} {_fmt(value)}")

        metric("outer_step", "gauge", "Outer step this node is at.", [({}, _num(self.step))])
        metric("committed_steps_total", "counter", "Outer steps this node committed.", [({}, len(self.steps))])
        metric("skipped_steps_total", "counter", "Outer steps this node skipped.", [({}, self.skipped)])
        metric("train_loss", "gauge", "Mean inner-step training loss of the last committed step.",
               [({}, last.get("loss"))])
        metric("val_loss", "gauge", "Validation loss after the last committed step.", [({}, last.get("val_loss"))])
        metric("group_size", "gauge", "Members of the current all-reduce group.", [({}, len(self.group))])
        metric("bytes_sent_total", "counter", "All-reduce payload bytes sent.", [({}, self.totals["bytes_sent"])])
        metric("bytes_received_total", "counter", "All-reduce payload bytes received.",
               [({}, self.totals["bytes_recv"])])
        metric("inner_seconds_total", "counter", "Seconds spent in inner (compute) steps.",
               [({}, self.totals["seconds_inner"])])
        metric("comm_seconds_total", "counter", "Seconds from the end of inner steps to commit "
               "(election wait and all-reduce).", [({}, self.totals["seconds_comm"])])
        metric("compute_utilization", "gauge", "Inner-step seconds over inner plus communication seconds.",
               [({}, self.utilization())])
        kinds: dict[str, int] = {"direct": 0, "hole-punched": 0, "relayed": 0}
        for k in self.connections.values():
            kinds[k] = kinds.get(k, 0) + 1
        metric("connections", "gauge", "Connected peers by connection kind.",
               [({"kind": k}, n) for k, n in sorted(kinds.items())])
        metric("peers_known", "gauge", "Peers this node knows in the run or is connected to.",
               [({}, len(self.peers()))])
        metric("contributions_rejected_total", "counter", "Contributions rejected, by reason.",
               [({"reason": r}, n) for r, n in sorted(self.rejected_by_reason.items())])
        return "\n".join(lines) + "\n"


def _escape(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))
