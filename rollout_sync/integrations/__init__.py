"""The world outside: launchers that place a job's processes, and other trainers' protocols.

* :mod:`.launch` - launcher-neutral: who is who by rank (:class:`~.launch.JobLayout`), the
  rendezvous a launcher gives (:class:`~.launch.JobContext`, :func:`~.launch.torchrun_context`),
  and commands across hosts on the job's store (:class:`~.launch.StoreCommandQueue`).
* :mod:`.ray` - the job as Ray actors, one placement-group bundle per process
  (:class:`~.ray.RayJob`); imports Ray only when used.

docs/deploy.md has the commands for torchrun across nodes and for an existing Ray cluster.
"""
