"""Fragment-wise (streaming) overlapped DiLoCo in `bench diloco`'s simulation (issue 17).

Streaming DiLoCo (arXiv 2501.18512): the flat parameter vector is split into P fragments and
each fragment is synchronized every H inner steps, the fragments staggered by H / P steps,
so a round carries 1/P of the payload and one starts every H / P steps. On a link where the
whole vector's all-reduce takes a whole phase (`diloco_overlap` with land = 1, the case
`bench utilization` is built around), a fragment's round takes H / P steps: its average lands
H / P steps after its round began instead of H, while the bytes per H steps are the same.

Per worker and fragment f the arithmetic is `overlap_math`'s, on f's slice: the fragment's
contribution is start_f - y_f; at its round the start moves by the scheme ("eager": the
Nesterov step with the worker's own delta standing in for the average; "delayed": nothing);
the committed fragment lands `land` steps later by `rebase`. The committed state changes only
by the Nesterov step on the fp32 mean of one fragment, on every worker alike. After the last
inner step every fragment's outstanding progress is averaged in one final round (`flush`),
so the evaluated model holds all the training, as synchronous DiLoCo's last round does.

Fragments are the network's (`p2ptrain.train.fragments`): strided blocks of the flat
vector, so every fragment spans every layer (the paper's "strided" pattern).
"""

from __future__ import annotations

import argparse

STREAM_BLOCK = None
"""Block size of the fragments (None: the network's, p2ptrain.train.fragments.BLOCK)."""


def add_arguments(p) -> None:
    p.add_argument("--stream-fragments", type=int, default=None, metavar="P",
                   help="streaming: fragments P (H must be a multiple of P; default 4)")
    p.add_argument("--stream-scheme", default=None, choices=["eager", "delayed", "none"],
                   help="streaming: a fragment's start point while its round is in flight (default eager; "
                        "none = no overlap, the round lands before the next step)")
    p.add_argument("--stream-flush", action=argparse.BooleanOptionalAction, default=None,
                   help="streaming: a final round of every fragment's outstanding progress (default on)")


def train(models, opts, outer, batch, step_fn, H: int, rounds: int, P: int, scheme: str, land_frac: float,
          flush: bool = True) -> dict:
    """Run rounds * H inner steps per worker with fragment rounds every H / P steps; afterwards
    models[0] holds the committed params. `land_frac`: the fraction of the H / P-step interval
    done when a fragment's average lands (1: when the next fragment's round starts)."""
    import torch

    from p2ptrain.train import fragments
    from p2ptrain.train import overlap_math as om
    from p2ptrain.train.outer import flatten, unflatten_into

    if P < 1 or H % P or scheme not in ("eager", "delayed", "none") or not 0 <= land_frac <= 1:
        raise ValueError("need H a multiple of P >= 1, scheme eager/delayed/none, 0 <= land <= 1")
    M, Hf = len(models), H // P
    tau = 0 if scheme == "none" else round(land_frac * Hf)
    fr = fragments.Fragments(outer.outer.numel(), P, STREAM_BLOCK or fragments.BLOCK)
    cfg = outer.cfg
    starts = [outer.outer.clone() for _ in range(M)]
    pending: list = []  # (land at inner step, fragment, committed slice)
    last = [0] * P  # inner step of each fragment's last round
    synced = 0

    def params(w):
        return list(models[w].parameters())

    def land_due(s: int) -> None:
        while pending and pending[0][0] <= s:
            _, f, committed = pending.pop(0)
            for w in range(M):
                y = flatten(params(w))
                fr.put(y, f, om.rebase(fr.part(y, f), fr.part(starts[w], f), committed))
                fr.put(starts[w], f, committed)
                unflatten_into(y, params(w))

    def fragment_round(f: int, s: int) -> None:
        nonlocal synced
        ys = [flatten(params(w)) for w in range(M)]
        deltas = [om.contribution(fr.part(starts[w], f), fr.part(ys[w], f)) for w in range(M)]
        x, m = fr.part(outer.outer, f), fr.part(outer.momentum, f)
        for w in range(M):  # the start while the round is in flight (from x, m *before* the step)
            start = om.phase_start(scheme if scheme != "none" else "delayed", x, m, fr.part(ys[w], f), deltas[w],
                                   cfg.lr, cfg.momentum, cfg.nesterov)
            fr.put(starts[w], f, start)
            if scheme == "eager":
                fr.put(ys[w], f, start)
                unflatten_into(ys[w], params(w))
        # the network's outer step on one fragment (OuterOptimizer.step with frags)
        outer.step(torch.stack(deltas).mean(0), load_model=False, frags=fr, t=f)
        pending.append((s + tau, f, fr.part(outer.outer, f).clone()))
        last[f], synced = s, synced + 1

    S = rounds * H
    for s in range(S):
        land_due(s)
        for w, (m, (opt, sched)) in enumerate(zip(models, opts)):
            step_fn(m, opt, sched, [batch(w, s)])
        if (s + 1) % Hf == 0:
            if tau == Hf:  # lands as the next fragment's round starts
                land_due(s + 1)
            fragment_round(((s + 1) // Hf - 1) % P, s + 1)
            if tau == 0:
                land_due(s + 1)
    land_due(S + H)
    if flush:  # every fragment's progress since its last round, in one final round
        for f in range(P):
            if last[f] < S:  # (a fragment whose round just ran has no progress: no momentum-only step)
                fragment_round(f, S)
        land_due(S + H)
    unflatten_into(outer.outer, params(0))
    return {"fragment_rounds": synced, "fragments": P, "land_steps": tau}
