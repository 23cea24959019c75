"""Terms of the local objective, chosen per round by the cloud (docs/architecture.md "Seams").

The local loss is the task loss plus the terms the assignment names in
``Assignment.objectives`` (protocol minor 2) and, for older configurations,
``train.prox_mu`` (the ``fedprox`` term). Each term is a small module in this package or
any module that subclasses :class:`ObjectiveTerm` with a ``name``; third-party packages
register theirs under the ``fedmoe.objectives`` entry-point group.
"""

from __future__ import annotations

from .base import ObjectiveTerm, TermContext, check_objectives, terms_for

__all__ = ["ObjectiveTerm", "TermContext", "check_objectives", "terms_for"]
