"""MoE routing replay for transformers models, usable without TRL. See `replay.py`; routes recorded where tokens
were sampled (HF generate): `rollout.py`."""

from .replay import Recording, RoutingReplay, RoutingReplayError, drift_statistics, find_routers, route_changes
from .rollout import (GenerationRecording, SampledRoutes, check_sampled_routes, has_route, no_route, pad_routes_like,
                      record_generation, route_dtype)

__all__ = ["GenerationRecording", "Recording", "RoutingReplay", "RoutingReplayError", "SampledRoutes",
           "check_sampled_routes", "drift_statistics", "find_routers", "has_route", "no_route", "pad_routes_like",
           "record_generation", "route_changes", "route_dtype"]
