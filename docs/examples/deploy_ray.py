"""docs/deploy.md: the entry point of docs/examples/deploy_torchrun.py on Ray (region ``ray``).

``RayJob`` starts a local Ray cluster for the job (on loopback) and stops it after, so nothing
is left running. Two ranks, a trainer and one replica, end bit-identical.
"""

# ruff: noqa: E402 - the fill-in (the entry point, by value) comes before the region's imports

import deploy_torchrun  # beside this file: its entry point, shipped to the actors by value
import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(deploy_torchrun)
entry = deploy_torchrun.entry

# [doc:ray]
from rollout_sync.launch.ray import RayJob

# On a cluster: address="auto" (or "head:6379"), and bundle={"CPU": 1, "GPU": 1} on GPUs.
with RayJob(world_size=2, timeout_s=120) as job:  # no address: a local cluster for the job
    # {rank: entry's value}; a failing rank raises GroupProcessError with its traceback, and
    # the other ranks are killed
    results = job.run(entry)
# [/doc:ray]
assert sorted(results) == [0, 1] and results[0] == results[1], results
print(f"ray: 2 ranks, bit-identical weights {results[0]}")
