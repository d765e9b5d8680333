"""`p2ptrain bench lossgate`: what the loss gate (rules L1, L2) costs a peer, against its own work.

One process, one model (`--preset`), the run's own data. Per round it times, on this machine:
  - phase: one inner phase (H AdamW steps), the work a peer does per outer step (baseline);
  - gate: L1's score of a round's candidate (the loss of the base and of the stepped state
    on `--batches` x the run's batch, on the scorer's own model), paid by a member in a
    round holding someone it has no standing with;
  - attribution: L2's score of `--suspects` members' evidence alone after a refusal (one
    stepped state each), plus the evidence it fetches: 4 bytes a parameter per suspect.
It prints each as a ratio of the phase (medians over `--rounds`), the evidence bytes, and
whether the gate passed the honest candidate and refused the red team's anti-update (-2.5x).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--preset", default="tiny", choices=("tiny", "small", "base"), help="model (default tiny)")
    p.add_argument("--inner-steps", type=int, default=20, help="H (default 20)")
    p.add_argument("--batches", type=int, default=2, help="gate batches (default 2, the product's)")
    p.add_argument("--suspects", type=int, default=4, help="evidence scored after a refusal (default 4)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--json", action="store_true", help="JSON lines; the last is the summary")


def run(args) -> int:
    import numpy as np

    from p2ptrain.cli.main import main as cli
    from p2ptrain.run import lossgate, manifest as mf
    from p2ptrain.run.spec import RunSpec
    from p2ptrain.train.local import LocalModel, load_run_data
    from p2ptrain.train.scorer import CandidateScorer

    with tempfile.TemporaryDirectory(prefix="p2ptrain-bench-lossgate-") as d:
        d = Path(d)
        if cli(["init", "--out", str(d / "run"), "--key", str(d / "k"), "--preset", args.preset,
                "--inner-steps", str(args.inner_steps)]) != 0:
            return 1
        spec = RunSpec.from_dict(mf.read(d / "run" / "run.toml")[0])
        local = LocalModel(spec, load_run_data(spec), b"bench", (d / "run" / "genesis.p2ck").read_bytes())
        scorer = CandidateScorer(local, lossgate.GateConfig(batches=args.batches))
        rows = []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            local.inner()
            phase = time.perf_counter() - t0
            delta = local.pseudo_gradient()
            seed = lossgate.round_seed("bench", f"{r}/0", {"m": r.to_bytes(4, "little")})
            t0 = time.perf_counter()
            before, after = scorer(delta, seed)
            gate = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(args.suspects):
                _, alone = scorer(delta * np.float32(-2.5), seed)
            attribution = time.perf_counter() - t0
            local.outer_step(delta)
            rows.append({"event": "bench_lossgate_round", "round": r, "phase_s": round(phase, 4),
                         "gate_s": round(gate, 4), "attribution_s": round(attribution, 4),
                         "honest_passed": lossgate.verdict(before, after) is None,
                         "anti_convicted": lossgate.judge_evidence(before, alone) == "loss-rose"})
        med = {k: statistics.median(x[k] for x in rows) for k in ("phase_s", "gate_s", "attribution_s")}
        summary = {"event": "bench_lossgate_summary", "preset": args.preset, "params": local.n_params,
                   "inner_steps": args.inner_steps, "batches": args.batches, "suspects": args.suspects,
                   **{k: round(v, 4) for k, v in med.items()},
                   "gate_over_phase": round(med["gate_s"] / med["phase_s"], 4),
                   "attribution_over_phase": round(med["attribution_s"] / med["phase_s"], 4),
                   "evidence_bytes_per_suspect": 4 * local.n_params,
                   "honest_passed": sum(x["honest_passed"] for x in rows),
                   "anti_convicted": sum(x["anti_convicted"] for x in rows), "rounds": len(rows)}
    for row in (*rows, summary):
        print(json.dumps(row) if args.json else " ".join(f"{k}={v}" for k, v in row.items() if k != "event"))
    return 0
