"""Placing our own job's processes: the trainer and the rollout replicas, one process each.

* :mod:`.job` - launcher-neutral: who is who by rank (:class:`~.job.JobLayout`), the
  rendezvous a launcher gives (:class:`~.job.JobContext`), and commands across hosts on the
  job's store (:class:`~.job.StoreCommandQueue`).
* :mod:`.torchrun` - the context from torchrun's environment (:func:`~.torchrun.torchrun_context`).
* :mod:`.ray` - the job as Ray actors, one placement-group bundle per process
  (:class:`~.ray.RayJob`); imports Ray only when a job starts.

Other frameworks' protocols (cosmos-rl, Fast-LLM) are in :mod:`rollout_sync.integrations`.
docs/deploy.md has the commands for torchrun across nodes and for an existing Ray cluster.
"""

from .job import JobContext as JobContext
from .job import JobLayout as JobLayout
from .job import QueueStore as QueueStore
from .job import Role as Role
from .job import StoreCommandQueue as StoreCommandQueue
from .job import command_queues as command_queues
from .job import results_on_trainer as results_on_trainer
from .ray import RayJob as RayJob
from .torchrun import torchrun_context as torchrun_context

__all__ = [
    "JobContext",
    "JobLayout",
    "QueueStore",
    "RayJob",
    "Role",
    "StoreCommandQueue",
    "command_queues",
    "results_on_trainer",
    "torchrun_context",
]
