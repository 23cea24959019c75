"""Model adapters: where routers and experts live in each supported family."""

from .base import ModelAdapter, MoEModel, all_experts, get_adapter, trains_all_weights
from .moe import ExpertFFN, MoELayer, Router, RoutingRecord, SparseMoeBlock, moe_blocks

__all__ = [
    "ModelAdapter", "MoEModel", "all_experts", "get_adapter", "trains_all_weights",
    "ExpertFFN", "MoELayer", "Router", "RoutingRecord", "SparseMoeBlock", "moe_blocks",
]
