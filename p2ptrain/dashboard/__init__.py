"""The local web dashboard: what one node sees of its run, live in a browser, and as
Prometheus metrics. `state` aggregates (pure logic), `server` serves it over HTTP."""
