"""Where protocol randomness that is not key material comes from: DHT reply salts and tie
breaks, donor order. It must be unpredictable to other peers (an OS-seeded generator), and
the simulator (`p2ptrain.sim.world`) replaces it with a seeded one, so a simulated world
replays exactly. Keys and signatures never draw from here."""

from __future__ import annotations

import random

source: random.Random = random.SystemRandom()


def rng() -> random.Random:
    """A fresh generator seeded from `source` (for a burst of draws)."""
    return random.Random(source.getrandbits(64))
