"""The simulated executor: charges each step's modelled cost to a virtual clock and samples a
dummy token for every chunk that completes a prefill or decodes."""

from __future__ import annotations

from dataclasses import dataclass

from jitney.core.outputs import ExecutorResult, SchedulerOutput
from jitney.sim.costs import CostModel, shape_of

DUMMY_TOKEN = 0


@dataclass
class VirtualClock:
    """The scheduler's clock callable in simulation: seconds, moved only by the simulator."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class SlotCounters:
    """Output-token slots a batch paid for vs. those that produced a wanted token. A static wave
    keeps paying for the slots of its finished requests (padding decode slots)."""

    steps: int = 0
    useful_slots: int = 0
    paid_slots: int = 0
    padding_prefill_tokens: int = 0
    busy_seconds: float = 0.0


class SimExecutor:
    def __init__(self, cost: CostModel, clock: VirtualClock) -> None:
        self.cost = cost
        self.clock = clock
        self.counters = SlotCounters()

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        dt = self.cost.step_seconds(shape_of(output))
        self.clock.now += dt
        sampled = {c.request_id: DUMMY_TOKEN for c in output.chunks if c.sample}
        n = self.counters
        n.steps += 1
        n.useful_slots += len(sampled)
        n.paid_slots += len(sampled) + output.num_padding_decode_slots
        n.padding_prefill_tokens += output.num_padding_prefill_tokens
        n.busy_seconds += dt
        return ExecutorResult(sampled, step_seconds=dt)
