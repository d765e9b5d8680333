"""Overlapped DiLoCo in `bench diloco`'s in-process simulation (issue 17).

The network's overlapped loop (`p2ptrain.train.overlap`) with the one-round delay made
explicit: the average of phase r is committed when every worker has finished phase r, but
it *lands* on each worker only `land` inner steps into phase r+1 (land = H: the round takes a
whole phase, the worst case `bench utilization` is built around). Until then each worker
trains from its scheme's start point (`overlap_math.phase_start`); the landing is
`overlap_math.rebase`; contributions are `overlap_math.contribution`. The committed outer
state is the same Nesterov step on the fp32 mean as synchronous DiLoCo, and the evaluated
model is that committed state (the final round lands before evaluation).
"""

from __future__ import annotations

OVERLAP_AVGS = ("delayed", "eager", "mixed")
SIMULATED = (*OVERLAP_AVGS, "streaming")


def add_arguments(p) -> None:
    p.add_argument("--overlap-land", type=float, default=None,
                   help="delayed/eager/mixed: fraction of the next phase done when a round's average lands (default 1)")
    p.add_argument("--overlap-outer-lr", type=float, default=None, help="their outer lr (default: DiLoCo's)")
    p.add_argument("--overlap-outer-momentum", type=float, default=None, help="their outer momentum (default: DiLoCo's)")
    p.add_argument("--eager-scale", type=float, default=None, help="eager: stand-in = this x own delta (default 1)")
    p.add_argument("--overlap-extra", default=None, metavar="E0,E1,..",
                   help="extendable phases (train.max_inner_steps): worker w's extra inner steps per phase, "
                        "taken while the average has not landed (needs --overlap-land 1)")
    p.add_argument("--overlap-shift", type=int, default=None, metavar="K",
                   help="eager: each phase's start point lands K inner steps into it; the phase trains from "
                        "the last one's end until then (the phase worker computes it beside the first steps)")
    from p2ptrain.bench import diloco_stream

    diloco_stream.add_arguments(p)


def outer_step(st, avg: str, lr: float, momentum: float) -> tuple[float, float]:
    """The outer lr and momentum configuration `avg` trains with (the overlapped schemes may
    have their own: Settings.overlap_outer_lr / overlap_outer_momentum)."""
    if avg not in SIMULATED:
        return lr, momentum
    return (lr if st.overlap_outer_lr is None else st.overlap_outer_lr,
            momentum if st.overlap_outer_momentum is None else st.overlap_outer_momentum)


def simulate(st, avg: str, models, opts, outer, batch, step_fn, H: int, rounds: int) -> dict | None:
    """Train an overlapped scheme (`train`) or streaming (`diloco_stream.train`) in place of
    synchronous DiLoCo's loop; None for the synchronous schemes (the caller runs them)."""
    if avg in OVERLAP_AVGS:  # fp32 mean, one-round-delayed landing
        train(models, opts, outer, batch, step_fn, H, rounds, avg, round(st.overlap_land * H), st.eager_scale,
              st.overlap_extra, st.overlap_shift)
        return {}
    if avg == "streaming":  # fragment rounds every H / P steps, fp32 mean
        from p2ptrain.bench import diloco_stream

        return diloco_stream.train(models, opts, outer, batch, step_fn, H, rounds, st.stream_fragments,
                                   st.stream_scheme, st.overlap_land, st.stream_flush)
    return None


class _Held:
    """A schedule that does not move: a phase's extra steps train at the current lr."""

    def step(self) -> None:
        pass


def train(models, opts, outer, batch, step_fn, H: int, rounds: int, scheme: str, land: int,
          eager_scale: float = 1.0, extra: str = "", shift: int = 0) -> None:
    """Run `rounds` overlapped rounds; afterwards models[0] holds the committed params.
    `batch(w, s)`: worker w's batch at inner step s; `step_fn(model, opt, sched, batches)`.
    `extra` ("E0,E1,.."): worker w adds E_w steps to each phase before the average lands (a
    faster peer under train.max_inner_steps), on batches of their own, the schedule held.
    `shift` (eager): the start point lands that many steps into the phase (PhaseWorker),
    as an offset, like a round's average; one landing after it supersedes it."""
    import torch

    from p2ptrain.train import overlap_math as om
    from p2ptrain.train.outer import flatten, unflatten_into

    if scheme not in OVERLAP_AVGS or not 0 <= land <= H:
        raise ValueError(f"scheme must be one of {OVERLAP_AVGS} and 0 <= land <= H")
    M = len(models)
    adds = [int(x) for x in extra.split(",")] if extra else [0]
    adds = [adds[w % len(adds)] for w in range(M)]
    if min(adds) < 0 or (any(adds) and land != H):
        raise ValueError("extra steps must be >= 0, and are taken only when the average lands after the phase")
    if shift and (scheme != "eager" or not 0 < shift < H):
        raise ValueError("a start-point shift is simulated for the eager scheme, 0 < shift < H")
    targets: list = [None] * M  # eager starts not yet landed (shift > 0)
    starts = [outer.outer.clone() for _ in range(M)]
    pending = None  # the committed state of the last round, not yet landed on the workers
    last_avg, last_own = None, [None] * M  # "mixed": the last round's average and our deltas in it

    def land_on(w: int, to=None) -> None:
        params = list(models[w].parameters())
        to = pending if to is None else to
        unflatten_into(om.rebase(flatten(params), starts[w], to), params)
        starts[w], targets[w] = to, None

    for r in range(rounds):
        for w, (m, (opt, sched)) in enumerate(zip(models, opts)):
            for h in range(H):
                if targets[w] is not None and h == shift and (pending is None or land > shift):
                    land_on(w, targets[w])
                if pending is not None and h == land:
                    land_on(w)
                step_fn(m, opt, sched, [batch(w, r * H + h)])
            for j in range(adds[w]):
                step_fn(m, opt, _Held(), [batch(w, (1 << 40) + r * adds[w] + j)])
            if pending is not None and land == H:
                land_on(w)
        locals_ = [flatten(m.parameters()) for m in models]
        deltas = [om.contribution(starts[w], locals_[w]) for w in range(M)]
        cfg = outer.cfg
        if scheme == "mixed":
            guesses = [om.stand_in(deltas[w], last_avg, last_own[w], M) for w in range(M)]
        else:  # eager_scale < 1 shrinks the stand-in toward the momentum-only step
            guesses = [None if eager_scale == 1.0 else deltas[w] * eager_scale for w in range(M)]
        # each worker's next start uses the committed state *before* this round's step
        starts = [om.phase_start(scheme, outer.outer, outer.momentum, locals_[w], deltas[w], cfg.lr, cfg.momentum,
                                 cfg.nesterov, guesses[w]) for w in range(M)]
        mean = torch.stack(deltas).mean(0)
        outer.step(mean, load_model=False)
        pending = outer.outer.clone()
        # the average lands on the workers one round later: that is when "mixed" can use it
        last_avg, last_own = mean, deltas
        if scheme != "delayed":
            for w in range(M):
                if shift:  # the phase trains from where the last one ended until its start lands
                    targets[w], starts[w] = starts[w], locals_[w]
                else:
                    unflatten_into(starts[w], list(models[w].parameters()))
    unflatten_into(outer.outer, list(models[0].parameters()))
