"""MoE routing replay for transformers models, usable without TRL. See `replay.py`."""

from .replay import Recording, RoutingReplay, RoutingReplayError, find_routers

__all__ = ["Recording", "RoutingReplay", "RoutingReplayError", "find_routers"]
