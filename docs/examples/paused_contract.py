"""docs/backends.md: a backend author runs the paused() contract suite on their backend.

Run as a script, it runs the suite both ways: all at once (run_paused_contract, printing the
report), and as the pytest module a backend author would keep (pytest runs this very file).
"""

import sys

# isort: split
# [doc:backend]
import pytest
import torch

from rollout_sync import ThreadedRolloutBackend
from rollout_sync.testing import PAUSED_CONTRACT_CHECKS, PausedContract, run_paused_contract


class SimulatorBackend(ThreadedRolloutBackend):
    """Serves on a thread of its own, one simulator tick per step (the base class parks it
    between two steps)."""

    def __init__(self):
        super().__init__(pause_timeout=30.0)
        self.weights = {"policy.weight": torch.zeros(16, 16)}

    def served_weights(self):
        return self.weights

    def serve_step(self):
        torch.tanh(self.weights["policy.weight"] @ torch.ones(16))  # the tick's forward


# How the suite drives it: for a ThreadedRolloutBackend the defaults say it all (forwards are
# served steps, a stall is a section of its generation gate); each field can be overridden.
CONTRACT = PausedContract.for_threaded_backend("SimulatorBackend", SimulatorBackend)
# [/doc:backend]


# [doc:pytest]
@pytest.mark.parametrize("check", PAUSED_CONTRACT_CHECKS, ids=str)
def test_the_simulator_backend_keeps_the_paused_contract(check):
    reason = check.skip_reason(CONTRACT)  # a check the backend cannot express says why
    if reason is not None:
        pytest.skip(reason)
    check(CONTRACT)  # raises PausedContractViolation (an AssertionError) if a clause breaks


# [/doc:pytest]


if __name__ == "__main__":
    # [doc:run]
    print(run_paused_contract(CONTRACT))
    # SimulatorBackend: 7 passed, 0 skipped
    #   passed  check_noop_before_engine
    #   ...
    # [/doc:run]
    report = run_paused_contract(CONTRACT)
    assert len(report.passed) == len(PAUSED_CONTRACT_CHECKS), report
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
