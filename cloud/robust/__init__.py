"""Defences against poisoned updates (README "Poisoned updates"): update screening
(:mod:`.screening`), robust aggregation rules (:mod:`.rules`), client-level differential
privacy (:mod:`.dp`) and the pre-commit guard (:mod:`.guard`), configured by the
aggregator's ``defences`` section (:mod:`.config`) and applied by the round engine
through :class:`.defences.Defences`."""
