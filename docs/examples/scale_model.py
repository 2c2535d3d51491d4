"""The refit cost model on a fleet of one's own (docs/scale.md shows the region below).

Pure arithmetic: no process, no device. The constants are this example's assumptions; the
named fleet's, with their sources, are ``rollout_sync.scale.FLEET_1T``.
"""

from rollout_sync.scale import Link, Scenario, SyncCosts, Topology, estimate

# [doc:estimate]
scenario = Scenario(
    model_bytes=2 * 70 * 10**9,  # 70B parameters in bf16
    bucket_bytes=256 << 20,
    replicas=8,
    nic=Link(rate_bytes_per_s=50e9, latency_s=20e-6),  # one 400 Gb/s NIC per GPU
    staged=True,  # receive into staging, install while parked
    tensors=1_000,
    gpus_per_replica=4,
    trainer_ranks=64,
)
costs = SyncCosts(collective_s=200e-6, install_bytes_per_s=40e9, park_s=0.03)
for topology in Topology:
    e = estimate(topology, scenario, costs)
    print(e)  # refit, stall, busiest link, where the time goes
# [/doc:estimate]

relay = estimate(Topology.PIPELINED_RELAY, scenario, costs)
sharded = estimate(Topology.SHARDED, scenario, costs)
assert relay.implemented and sharded.implemented  # ShardedTransfer(pipelined_relay=True)
# One source's NIC carries the whole model; sharded, each replica GPU takes a quarter.
assert relay.busiest_link_bytes == 4 * sharded.busiest_link_bytes
assert relay.refit_s > 140e9 / 50e9 > sharded.refit_s
assert relay.stall_s == sharded.stall_s  # staged: the park and the same install per GPU
