"""docs/cosmos_rl.md: turning the guard on in a rollout process (region ``install``).

Needs cosmos-rl 0.4.7: it runs in ``.venv-cosmos`` (scripts/setup_cosmos_venv.sh;
tests/cosmos_rl_env/test_doc_example.py runs it there). The ``...`` of the region is where
cosmos runs; around it this file checks what ``install()`` changes in cosmos's own classes and
that ``uninstall()`` restores every one of them.
"""

# ruff: noqa: E402 - the fill-in (cosmos's classes as shipped) comes before the region's imports

from cosmos_rl.dispatcher.command import PolicyToRolloutUnicastCommand
from cosmos_rl.rollout.worker.rollout_control import DisaggregatedRolloutControlWorker
from cosmos_rl.utils.payload_transport.nccl import producer as producer_module


def cosmos_as_it_is() -> tuple[object, type]:
    """The P2R handler cosmos's registry dispatches to, and cosmos's payload producer class."""
    handler = DisaggregatedRolloutControlWorker.get_rollout_command_handler(
        PolicyToRolloutUnicastCommand
    )
    return handler, producer_module.NCCLPayloadProducer


shipped = cosmos_as_it_is()

# [doc:install]
from rollout_sync.integrations import cosmos_rl

guard = cosmos_rl.install()  # idempotent: a second call returns the same guard
...  # cosmos runs as usual
cosmos_rl.uninstall()  # optional: undoes every change below*
# [/doc:install]

assert isinstance(guard, cosmos_rl.CosmosRLGuard) and guard.syncs == 0
assert cosmos_as_it_is() == shipped, "uninstall() left a change behind"
with cosmos_rl.installed() as again:  # the same install, checked while it is in force
    assert cosmos_rl.install() is again
    handler, producer = cosmos_as_it_is()
    assert handler is not shipped[0] and hasattr(handler, "__rollout_sync_wrapped__")
    assert producer.__name__ == "HoldableNCCLPayloadProducer"
assert cosmos_as_it_is() == shipped
print("cosmos_rl: install() guards the P2R handler and the payload producer; uninstall() undoes")
