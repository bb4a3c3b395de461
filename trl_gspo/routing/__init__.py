"""MoE routing replay for transformers models, usable without TRL. See `replay.py`."""

from .replay import Recording, RoutingReplay, RoutingReplayError, drift_statistics, find_routers, route_changes

__all__ = ["Recording", "RoutingReplay", "RoutingReplayError", "drift_statistics", "find_routers", "route_changes"]
