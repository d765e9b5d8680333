"""The network simulator: the real protocol code, many peers, faults from a seed (issue 30).

`world.run(scenario, seed)` runs one world; `scenarios` holds the named ones and the random
generator `bench sim` sweeps; `invariants` is what every run is judged by. docs/DESIGN.md,
"Simulator", says how to write a scenario and replay a seed.
"""
