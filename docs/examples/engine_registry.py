"""docs/backends.md: what an engine provides (rollout_sync.engine), and registering it by name.

In one process: the engine is read for its capabilities, registered, looked up and built the way a
replica builds it (here with the job's config and a sender left out: this engine reads neither).
"""

# ruff: noqa: E402 - each region imports what it uses, as a reader copies it

# isort: split
# [doc:engine]
import torch

from rollout_sync import ThreadedRolloutBackend
from rollout_sync.engine import EngineCapabilities


class SimulatorBackend(ThreadedRolloutBackend):
    """Serves on a thread of its own, one simulator tick per step."""

    def __init__(self):
        super().__init__(pause_timeout=30.0)
        self.weights = {"policy.weight": torch.zeros(16, 16)}

    def served_weights(self):
        return self.weights

    def serve_step(self):
        torch.tanh(self.weights["policy.weight"] @ torch.ones(16))  # the tick's forward


print(EngineCapabilities.of(SimulatorBackend()))
# <EngineCapabilities SimulatorBackend: parks, background; staged, sync>
# [/doc:engine]
assert repr(EngineCapabilities.of(SimulatorBackend())) == (
    "<EngineCapabilities SimulatorBackend: parks, background; staged, sync>"
)

# [doc:register]
from rollout_sync import SyncMode
from rollout_sync.backends import (
    EngineHandle,
    EngineRequest,
    engine_factory,
    register_engine,
    registered_engine,
)


def simulator(request: EngineRequest) -> EngineHandle:
    """One replica's engine, not started: the worker starts it inside the first sync."""
    engine = SimulatorBackend()
    return EngineHandle(engine, lambda: {"forwards": engine.statistics().steps_served})


def trainer_weights(config):
    """The trainer's weights in the engine's names, and how each step moves them."""
    weights = {"policy.weight": torch.zeros(16, 16)}
    return weights, lambda step: weights["policy.weight"].fill_(float(step))


register_engine(
    "simulator",
    simulator,
    trainer_model=trainer_weights,
    modes=(SyncMode.SYNC, SyncMode.STAGED),
)
print(registered_engine("simulator"))
# <RegisteredEngine 'simulator': staged, sync; 3 replicas; any launcher; trainer model>
# [/doc:register]
assert repr(registered_engine("simulator")) == (
    "<RegisteredEngine 'simulator': staged, sync; 3 replicas; any launcher; trainer model>"
)

from rollout_sync import Timeline

handle = engine_factory("simulator")(EngineRequest(None, Timeline(), None))
assert isinstance(handle.rollout, SimulatorBackend) and handle.counters() == {"forwards": 0}
handle.close()

# [doc:unknown]
try:
    engine_factory("simulatr")
except KeyError as exc:
    print(exc.args[0])
# no engine is registered as 'simulatr'; registered: ['simulator']. Register it with ...
# [/doc:unknown]
try:
    engine_factory("simulatr")
except KeyError as exc:
    assert exc.args[0].startswith(
        "no engine is registered as 'simulatr'; registered: ['simulator']. Register it with"
    )
else:
    raise AssertionError("an unknown name was found")
