"""The arithmetic of overlapped outer steps (issue 17), as pure torch functions (no I/O).

Notation: x_t, m_t are the committed outer params and Nesterov momentum after t rounds (what
state records publish and `params_sha256` hashes). Inner phase p trains the local params y
from a start point s_p; its contribution to round p is the progress  delta_p = s_p - y.
Synchronous DiLoCo is the case s_p = x_p (the phase waits for round p-1).

Overlapped (phase p+1 trains while round p reduces delta_p):
  start    s_{p+1} = y_p                               "delayed": keep training locally
           s_{p+1} = nesterov(x_p, m_p, delta_p)[0]     "eager": this peer's own delta stands
                                                        in for the average (a scratch copy:
                                                        x_p and m_p are untouched)
           s_{p+1} = nesterov(x_p, m_p, g~)[0]          "mixed": the stand-in is the last
             g~ = a_{p-1} + (delta_p - delta_{p-1}) / M  landed average a_{p-1} with this
                                                        peer's share replaced by its fresh
                                                        delta (arXiv 2502.12996's eager
                                                        outer gradient, used only as a start)
  landing  when round p commits x_{p+1} (between two inner steps, or after the phase):
           y <- x_{p+1} + (y - s_{p+1}),  s_{p+1} <- x_{p+1}   (`rebase`)
The rebase moves the start point and the local params by the same vector, so delta_{p+1} =
s_{p+1} - y is the phase's own progress whenever the average lands; the stand-in is replaced
by the committed state, never added to it. A round that lands before the phase's first step
makes the phase exactly synchronous DiLoCo (y - s = 0, and x + 0 == x in IEEE arithmetic). A
skipped round lands as whatever state the peer then holds (caught up, or unchanged).

The committed state changes only by `OuterOptimizer.step` on a committed average, the same
math and bytes as the sequential loop: members stay bit-identical.
"""

from __future__ import annotations

import torch

SCHEMES = ("none", "delayed", "eager", "mixed")


def nesterov(x: torch.Tensor, m: torch.Tensor, g: torch.Tensor, lr: float, momentum: float,
             nesterov_: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', m') of one outer step on copies, in `OuterOptimizer.step`'s operation order (separately
    rounded multiplies and adds), so the eager stand-in is what the real step would give
    for this delta."""
    m2 = m.clone()
    if momentum > 0:
        m2.mul_(momentum).add_(g)
        d = torch.mul(m2, momentum).add_(g) if nesterov_ else m2
    else:
        d = g
    return x - torch.mul(d, lr), m2


def stand_in(delta: torch.Tensor, last_avg: torch.Tensor | None, last_own: torch.Tensor | None,
             world: int) -> torch.Tensor:
    """"mixed": the last landed average with our share in it replaced by our fresh delta.
    Until a round has landed (or when we had no share in it) that is delta / world: the
    others' unknown deltas count as zero rather than as copies of ours."""
    if world < 1:
        raise ValueError("world must be >= 1")
    if last_avg is None or last_own is None:
        return delta / world
    return last_avg + (delta - last_own) / world


def phase_start(scheme: str, x: torch.Tensor, m: torch.Tensor, local: torch.Tensor, delta: torch.Tensor,
                lr: float, momentum: float, nesterov_: bool = True, guess: torch.Tensor | None = None) -> torch.Tensor:
    """Where the next phase starts while round p (delta) is in flight (module docstring);
    `guess`: "mixed"'s stand-in (`stand_in`); for "eager", replaces the delta (a scaled one)."""
    if scheme == "delayed":
        return local.clone()
    if scheme == "eager":
        return nesterov(x, m, delta if guess is None else guess, lr, momentum, nesterov_)[0]
    if scheme == "mixed":
        if guess is None:
            raise ValueError("the mixed scheme needs its stand-in (overlap_math.stand_in)")
        return nesterov(x, m, guess, lr, momentum, nesterov_)[0]
    if scheme == "none":
        return x.clone()
    raise ValueError(f"unknown overlap scheme {scheme!r}")


def rebase(local: torch.Tensor, start: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
    """The local params once the committed state lands: committed + progress since `start`."""
    if not local.shape == start.shape == committed.shape:
        raise ValueError("rebase needs three vectors of one shape")
    return committed + (local - start)


def contribution(start: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A phase's pseudo-gradient: its start point minus where it ended."""
    return start - local
