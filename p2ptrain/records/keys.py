"""Every DHT key a run (and the lobby) uses, named in one place.

All keys live under `p2ptrain.dht.record.NAMESPACE` (the DHT refuses others). A run's keys
are `/p2ptrain/<run id>/<what>`; the lobby's presence uses a namespace in the run id's place.
Records under these keys are multi-writer: each peer writes its own subkey (its peer id).
Their codecs are `p2ptrain.records.codecs` (the manifest's: `p2ptrain.records.manifest`);
reading and writing them goes through `p2ptrain.records.board.RunRecords`.

  manifest    the signed run manifest, served by every member
  ready/<t>   "ready for outer step t", read by the election (ready/<t>/<l>.<c>: one cell of it)
  state       each member's newest state (state/<t>/<l>.<c>: those at or just past step t, by cell)
  providers   checkpoint provider records (the quorum rule: `p2ptrain.ckpt.providers`;
              providers/<t>/<params>: those of one state)
  reputation  robust-rule reports (the verdict: `p2ptrain.run.reputation`)
  data        peers serving the run's tokenizer and token stream (`p2ptrain.train.shards`)
  peers       presence, per run or lobby (`p2ptrain.net.presence`)
"""

from __future__ import annotations

from p2ptrain.dht.record import MAX_ADDRS, NAMESPACE

__all__ = ["MAX_ADDRS", "NAMESPACE", "manifest", "ready", "state", "data", "providers", "reputation", "presence"]


def _key(scope: str, what: str) -> str:
    return f"{NAMESPACE}{scope}/{what}"


def manifest(run_id: str) -> str:
    return _key(run_id, "manifest")


def ready(run_id: str, step: int, level: int = 0, cell: int = 0) -> str:
    """Level 0 is the whole step (`ready/<t>`); level l >= 1 holds one of 4**l cells of the
    placement hash (`ready/<t>/<l>.<cell>`; the rule: `p2ptrain.run.election`, "Cells")."""
    return _key(run_id, f"ready/{step}" if level == 0 else f"ready/{step}/{level}.{cell}")


def state(run_id: str, step: int | None = None, level: int = 0, cell: int = 0) -> str:
    """`state`: every member's newest state (status, catch-up). With `step`, the same records
    filed by step, in the cells of that step's ready records (`state/<t>`, `state/<t>/<l>.<c>`):
    what the election reads to know whom to expect (`p2ptrain.run.elect.publish_state`)."""
    if step is None:
        return _key(run_id, "state")
    return _key(run_id, f"state/{step}" if level == 0 else f"state/{step}/{level}.{cell}")


def data(run_id: str) -> str:
    return _key(run_id, "data")


def providers(run_id: str, step: int | None = None, params: str | None = None) -> str:
    """`providers`: every member's newest provider record (the head, H1). With `step` and
    `params`, those of one state (`providers/<t>/<params hash>`): a merge round's fetch of
    a base reads its G holders' records, not the run's O(N)."""
    if step is None or params is None:
        return _key(run_id, "providers")
    return _key(run_id, f"providers/{step}/{params[:64]}")


def reputation(run_id: str) -> str:
    return _key(run_id, "reputation")


def presence(namespace: str) -> str:
    """A run id, or 'lobby' before joining a run."""
    return _key(namespace, "peers")
