"""`p2ptrain bench lossgate`: what the loss gate (rules L1, L2) costs and how often it errs.

One process, the run's own data, `--peers` honest DiLoCo peers of one model (`--preset`) that
train and apply their mean each round, and one more identity sending -2.5x its own update
(the red team's anti-update). Per round, with the product's scorer (`p2ptrain.train.scorer`)
on the round's batch, it records:
  - phase: one peer's inner phase (H AdamW steps): the work a peer does per outer step, the
    baseline every cost is divided by;
  - gate: L1's score of the honest mean (the reference, momentum alone, and the stepped
    state), paid by a member in a round holding someone it has no standing with; whether it
    passed (a refusal of honest work is a false refusal);
  - pieces: L2's score of each honest peer's work alone and of the anti-update (from the
    round's starting state without momentum, rule L2b), one forward
    pass each, plus the evidence each fetches (4 bytes a parameter); a piece that fails on
    the round's batch is scored on `--confirm` further batches and convicted only if it
    fails on each (the product's rule): honest convictions are false ones, the anti-update's
    are catches;
  - hidden: whether the mean with the anti-update in it (one among `--peers` honest) still
    passes L1 -- the case only L2's pieces catch.
A mean (honest or with the anti-update) that fails on the round's batch is scored on the
`--confirm` further batches and refused only if it fails on each (rule L1b), as the product
does when no piece is convicted; `mean_failed_once` counts the honest means that failed on
the round's batch.
`--worlds W` repeats the whole run W times with other peer identities (each world's own
data order); `--init` passes further `p2ptrain init` flags (e.g. the checkpoint test's
'--batch-size 4 --seq-len 64 --warmup 5'). The summary gives the medians as ratios of the
phase and the counts over all rounds of all worlds.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--preset", default="tiny", choices=("tiny", "small", "base"), help="model (default tiny)")
    p.add_argument("--inner-steps", type=int, default=20, help="H (default 20)")
    p.add_argument("--peers", type=int, default=4, help="honest peers (default 4)")
    p.add_argument("--batches", type=int, default=2, help="gate batches (default 2, the product's)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--confirm", type=int, default=2, help="further batches for a failing piece (default 2, the product's)")
    p.add_argument("--worlds", type=int, default=1, help="independent runs, other peer identities (default 1)")
    p.add_argument("--pieces-from", default="start", choices=("start", "momentum"),
                   help="L2's base: the round's state (rule L2b, the product's) or momentum alone (before L2b)")
    p.add_argument("--init", default="", help="further `p2ptrain init` flags, one string")
    p.add_argument("--json", action="store_true", help="JSON lines; the last is the summary")


def run(args) -> int:
    from p2ptrain.cli.main import main as cli
    from p2ptrain.run import lossgate, manifest as mf
    from p2ptrain.run.spec import RunSpec
    from p2ptrain.train.local import load_run_data

    with tempfile.TemporaryDirectory(prefix="p2ptrain-bench-lossgate-") as d:
        d = Path(d)
        with contextlib.redirect_stdout(io.StringIO()):  # init's own lines are not this bench's events
            if cli(["init", "--out", str(d / "run"), "--key", str(d / "k"), "--preset", args.preset,
                    "--inner-steps", str(args.inner_steps), *shlex.split(args.init)]) != 0:
                return 1
        spec = RunSpec.from_dict(mf.read(d / "run" / "run.toml")[0])
        ds, genesis = load_run_data(spec), (d / "run" / "genesis.p2ck").read_bytes()
        cfg = lossgate.GateConfig(batches=args.batches, confirm=args.confirm)
        rows = []
        for w in range(args.worlds):
            got, n_params = world(args, w, spec, ds, genesis, cfg)
            rows += got
        med = {k: statistics.median(x[k] for x in rows) for k in ("phase_s", "gate_s", "piece_s")}
        summary = {"event": "bench_lossgate_summary", "preset": args.preset, "params": n_params, "worlds": args.worlds,
                   "pieces_from": args.pieces_from,
                   "inner_steps": args.inner_steps, "peers": args.peers, "batches": args.batches,
                   "rounds": len(rows), **{k: round(v, 4) for k, v in med.items()},
                   "gate_over_phase": round(med["gate_s"] / med["phase_s"], 4),
                   "piece_over_phase": round(med["piece_s"] / med["phase_s"], 4),
                   "evidence_bytes_per_piece": 4 * n_params,
                   "honest_means_failed_once": sum(x["mean_failed_once"] for x in rows),
                   "honest_means_refused": sum(not x["mean_passed"] for x in rows),
                   "confirm": args.confirm,
                   "honest_pieces_failed_once": sum(x["honest_pieces_failed_once"] for x in rows),
                   "honest_pieces_convicted": sum(x["honest_pieces_convicted"] for x in rows),
                   "honest_pieces": len(rows) * args.peers,
                   "honest_pieces_convicted_at_step1": sum(x["honest_pieces_convicted"] for x in rows if x["round"] == 1),
                   "anti_caught_at_step1": sum(x["anti_caught"] for x in rows if x["round"] == 1),
                   "anti_caught": sum(x["anti_caught"] for x in rows),
                   "anti_hidden_by_mean": sum(x["anti_hidden_by_mean"] for x in rows)}
    for row in (*rows, summary):
        print(json.dumps(row) if args.json else " ".join(f"{k}={v}" for k, v in row.items() if k != "event"))
    return 0


def world(args, w: int, spec, ds, genesis: bytes, cfg) -> tuple[list[dict], int]:
    """One world's rounds (and the model's size): `--peers` honest peers and the anti-update's
    identity, ids from `w`."""
    import numpy as np

    from p2ptrain.run import lossgate
    from p2ptrain.train.local import LocalModel
    from p2ptrain.train.scorer import CandidateScorer

    peers = [LocalModel(spec, ds, bytes([(w * (args.peers + 1) + i + 1) % 256]) * 8, genesis)
             for i in range(args.peers + 1)]
    scorer = CandidateScorer(peers[0], cfg)
    rows = []

    score_piece = scorer.piece if args.pieces_from == "start" else scorer

    def judged(x, seed):  # L2, as `p2ptrain.run.evidence.judge_all`
        return lossgate.judge_piece(lambda sd: score_piece(x, sd), seed, args.confirm)

    def mean_verdict(x, seed, first=None):  # L1 with L1b, as `lossgate.make_gate` when no piece is convicted
        why = lossgate.verdict(*(first or scorer(x, seed)), cfg.margin)
        return why and lossgate.confirm_mean(lambda sd: scorer(x, sd), seed, cfg, why)
    for r in range(args.rounds):
        phases, deltas = [], []
        for p in peers:
            t0 = time.perf_counter()
            p.inner()
            phases.append(time.perf_counter() - t0)
            deltas.append(p.pseudo_gradient())
        honest, anti = deltas[:-1], deltas[-1] * np.float32(-2.5)
        mean = np.mean(honest, axis=0).astype(np.float32)
        seed = lossgate.round_seed("bench", f"{w}/{r}/0", {"m": r.to_bytes(4, "little")})
        t0 = time.perf_counter()
        ref, after = scorer(mean, seed)
        gate = time.perf_counter() - t0
        t0 = time.perf_counter()
        alone = [judged(x, seed) for x in honest]
        piece = (time.perf_counter() - t0) / sum(len(sc) for _, sc in alone)
        anti_why, anti_scores = judged(anti, seed)
        mixed = np.mean([*honest, anti], axis=0).astype(np.float32)
        hidden = mean_verdict(mixed, seed) is None
        for p in peers:
            p.outer_step(mean)
        rows.append({"event": "bench_lossgate_round", "world": w, "round": r, "phase_s": round(statistics.median(phases), 4),
                     "gate_s": round(gate, 4), "piece_s": round(piece, 4),
                     "mean_failed_once": lossgate.verdict(ref, after, cfg.margin) is not None,
                     "mean_passed": mean_verdict(mean, seed, (ref, after)) is None,
                     "honest_pieces_failed_once": sum(lossgate.judge_evidence(*sc[0]) is not None for _, sc in alone),
                     "honest_pieces_convicted": sum(why is not None for why, _ in alone),
                     "anti_caught": anti_why is not None, "anti_hidden_by_mean": hidden,
                     "mean_rel": round(after / ref - 1, 6),
                     "honest_rel_max": round(max(sc[0][1] / sc[0][0] - 1 for _, sc in alone), 6),
                     "anti_rel": round(anti_scores[0][1] / anti_scores[0][0] - 1, 6)})
    return rows, peers[0].n_params
