"""Assignment strategies, one module per strategy, selected by ``name`` in the config."""

from .base import AssignmentStrategy, get_assignment

__all__ = ["AssignmentStrategy", "get_assignment"]
