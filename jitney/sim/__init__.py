"""The simulator: the real scheduler on a virtual clock, with step cost models and traffic."""

from jitney.sim.costs import CostModel, LinearCost, ProfileCost, RooflineCost, shape_of
from jitney.sim.executor import SimExecutor, VirtualClock
from jitney.sim.roofline import Roofline, StepShape
from jitney.sim.seed_api import Req, simulate
from jitney.sim.simulator import SimResult, default_cache_config, run
from jitney.sim.traffic import TrafficItem, TrafficSpec, generate, load_trace

__all__ = [
    "CostModel",
    "LinearCost",
    "ProfileCost",
    "Req",
    "Roofline",
    "RooflineCost",
    "SimExecutor",
    "SimResult",
    "StepShape",
    "TrafficItem",
    "TrafficSpec",
    "VirtualClock",
    "default_cache_config",
    "generate",
    "load_trace",
    "run",
    "shape_of",
    "simulate",
]
