"""The run manifest on disk and as its initiator makes it: everything a peer needs to take
part in a run, signed by its initiator.

Its wire form, run id and signature check (what a peer checks a manifest fetched from
anyone with) are `p2ptrain.records.manifest`, re-exported here. On disk it is DIR/run.toml
(readable, editable only by making a new run).
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import Any

from p2ptrain.identity import Identity
from p2ptrain.records.manifest import (MAX_DEPTH, MAX_MANIFEST_BYTES, ManifestError, body_bytes,  # noqa: F401
                                       canonical, decode, encode, run_id, verify_manifest)


def parse_run_id(text: str) -> str:
    """A run id as typed by a user, checked before any network work: a malformed one would
    otherwise be looked up in the DHT until the manifest wait times out (issue 33)."""
    rid = text.strip().lower()
    wrong = (f"it has {len(rid)} characters" if len(rid) != 64 else
             "it has characters other than 0-9 and a-f" if set(rid) - set("0123456789abcdef") else "")
    if wrong:
        shown = text if len(text) <= 20 else text[:16] + "..."
        raise ManifestError(f"{shown!r} is not a run id ({wrong}): a run id is the 64 hex characters "
                            "`p2ptrain init` printed")
    return rid


def sign(manifest: dict, identity: Identity) -> dict:
    m = dict(manifest)
    m["initiator"] = {"peer": identity.peer_id_str, "public_key": identity.public.hex()}
    m["signature"] = identity.sign(body_bytes(m)).hex()
    return m


# -- TOML -------------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ManifestError("manifest values must be finite")
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ManifestError(f"cannot write {type(v).__name__} to TOML")


def to_toml(manifest: dict, rid: str) -> str:
    lines = [f"# p2ptrain run manifest. Run id: {rid}", "# Any edit changes the run id and breaks the signature.", ""]
    scalars = {k: v for k, v in manifest.items() if not isinstance(v, dict)}
    for k in sorted(scalars):
        lines.append(f"{k} = {_toml_value(scalars[k])}")
    for k in sorted(manifest):
        if isinstance(manifest[k], dict):
            lines += ["", f"[{k}]"]
            for kk in sorted(manifest[k]):
                lines.append(f"{kk} = {_toml_value(manifest[k][kk])}")
    return "\n".join(lines) + "\n"


def write(manifest: dict, directory: Path) -> str:
    rid = verify_manifest(manifest)
    text = to_toml(manifest, rid)
    if tomllib.loads(text) != manifest:  # the file must reproduce the exact manifest
        raise ManifestError("manifest does not round-trip through TOML")
    path = Path(directory) / "run.toml"
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return rid


def read(path: Path) -> tuple[dict, str]:
    try:
        with open(path, "rb") as f:
            manifest = tomllib.load(f)
    except FileNotFoundError:
        raise ManifestError(f"no manifest at {path}: create one with `p2ptrain init --out DIR`") from None
    except IsADirectoryError:
        inside = Path(path) / "run.toml"
        hint = f"; the manifest is the file {inside}" if inside.is_file() else ""
        raise ManifestError(f"{path} is a directory, not a manifest file{hint}") from None
    except OSError as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path} is not valid TOML: {exc}") from None
    return manifest, verify_manifest(manifest)
