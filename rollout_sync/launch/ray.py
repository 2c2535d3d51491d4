"""A job on Ray: one actor per rank, one placement-group bundle per actor, one entry point.

:class:`RayJob` places ``world_size`` actors in a placement group (one bundle each), asks the
trainer's actor for a rendezvous address on its node (a free port it found there), and runs
``entry(context, *args)`` on every actor with a :class:`~rollout_sync.launch.job.JobContext`
carrying that address: the same entry point a local or torchrun launch runs. Each rank's
return value comes back to the driver; a rank that raises comes back as its traceback,
and the others are given a grace period, then killed (:class:`~rollout_sync.errors.
GroupProcessError`). Every wait is bounded by ``timeout_s``.

With no ``address`` it starts a local Ray cluster for the job (on loopback, with enough logical
CPUs for one bundle per rank) and shuts it down on exit, so no Ray process is left behind; with
an ``address`` it joins that cluster and leaves it running. Ray is imported only here, and only
when a job starts (``pip install ray``)::

    from rollout_sync.launch.ray import RayJob

    with RayJob(world_size=4, timeout_s=300) as job:
        results = job.run(my_entry, config)   # my_entry(context, config) on ranks 0..3
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from .._deadline import deadline_after, remaining
from ..distributed import find_free_port
from ..errors import ChildFailure, GroupProcessError, MissingDependencyError
from .job import JobContext, JobLayout

__all__ = ["RayJob"]


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(
            f"RayJob needs Ray, which is not importable ({exc})", package="ray", extra="ray"
        ) from exc
    return ray


class _RankProcess:
    """The body of one rank's actor (made a Ray actor class by :func:`_actor_class`)."""

    def rendezvous_address(self, host: str | None) -> str:
        """``tcp://host:port`` with a port free on this node (the trainer hosts the store)."""
        if host is None:
            host = _ray().util.get_node_ip_address()
        return f"tcp://{host}:{find_free_port(host)}"

    def run(
        self,
        entry: Callable[..., Any],
        context: JobContext,
        args: tuple[Any, ...],
        intra_op_threads: int | None,
    ) -> tuple[str, Any]:
        import torch
        import torch.distributed as dist

        try:
            if intra_op_threads is not None:
                torch.set_num_threads(intra_op_threads)
            return "ok", entry(context, *args)
        except BaseException:  # noqa: BLE001 - reported to the driver with its traceback
            return "error", traceback.format_exc()
        finally:
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001, S110 - a broken group cannot be torn down
                    pass


_ACTOR: Any = None


def _actor_class() -> Any:
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = _ray().remote(_RankProcess)
    return _ACTOR


class RayJob:
    """Run one entry point per rank as Ray actors; see the module docstring.

    Args:
        world_size: processes of the job (the trainer and the replicas), or the job's
            :class:`~rollout_sync.launch.job.JobLayout` (a sharded job's:
            :meth:`~rollout_sync.launch.job.JobLayout.sharded`), which every rank's context
            then carries; one actor (and bundle) per process either way.
        address: an existing Ray cluster (``ray.init(address=...)``, e.g. ``"auto"`` or
            ``"ray://head:10001"``); ``None`` starts a local cluster for the job.
        bundle: the resources of each rank's placement-group bundle (``{"CPU": 1, "GPU": 1}``
            on GPUs: one GPU per bundle).
        strategy: the placement group's strategy (``"PACK"``, ``"SPREAD"``, ...).
        rendezvous_host: the address the trainer's rendezvous listens on; default the trainer
            actor's node IP (``127.0.0.1`` on a local cluster).
        trainer: the trainer's rank (with a layout: its own ``trainer``; leave this 0).
        timeout_s: the limit of placement, of the rendezvous address, and of the whole run.
        grace_s: after the first rank fails, how long the others get before they are killed.
        intra_op_threads: ``torch.set_num_threads`` on every rank (``None``: leave it).
        env: environment variables for the actors (Ray's ``runtime_env``).
    """

    def __init__(
        self,
        world_size: int | JobLayout,
        *,
        address: str | None = None,
        bundle: Mapping[str, float] | None = None,
        strategy: str = "PACK",
        rendezvous_host: str | None = None,
        trainer: int = 0,
        timeout_s: float = 600.0,
        grace_s: float = 10.0,
        intra_op_threads: int | None = 1,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(world_size, JobLayout):
            if trainer != 0:
                raise ValueError("RayJob(layout, trainer=...): the layout says who the trainer is")
            self.layout = world_size
        else:
            self.layout = JobLayout(world_size, trainer)
        self.address = address
        self.bundle = dict(bundle) if bundle is not None else {"CPU": 1.0}
        self.strategy = strategy
        self.rendezvous_host = rendezvous_host
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.intra_op_threads = intra_op_threads
        self.env = dict(env or {})
        self.started_cluster = False
        self._placement: Any = None
        self._actors: list[Any] = []

    def __repr__(self) -> str:
        where = self.address or "local cluster"
        return f"<RayJob {self.layout.world_size} ranks on {where}, {len(self._actors)} actors>"

    def __enter__(self) -> RayJob:
        ray = _ray()
        try:
            if not ray.is_initialized():
                if self.address is None:
                    # Logical CPUs: enough for one bundle per rank even on a small machine.
                    wanted = math.ceil(self.layout.world_size * self.bundle.get("CPU", 0))
                    ray.init(
                        num_cpus=max(os.cpu_count() or 1, wanted),
                        include_dashboard=False,
                        log_to_driver=False,
                        _node_ip_address="127.0.0.1",
                    )
                    self.started_cluster = True
                    if self.rendezvous_host is None:
                        self.rendezvous_host = "127.0.0.1"
                else:
                    ray.init(address=self.address, log_to_driver=False)
            self._place()
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release()

    def _place(self) -> None:
        _ray()  # a clear MissingDependencyError before the imports below
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._placement = placement_group(
            [dict(self.bundle) for _ in range(self.layout.world_size)], strategy=self.strategy
        )
        self._get(
            self._placement.ready(),
            f"no placement for bundles {self.bundle} (does the cluster have the resources?)",
        )
        options: dict[str, Any] = {
            "num_cpus": self.bundle.get("CPU", 0),
            "num_gpus": self.bundle.get("GPU", 0),
        }
        if self.env:
            options["runtime_env"] = {"env_vars": self.env}
        self._actors = [
            _actor_class()
            .options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._placement, placement_group_bundle_index=rank
                ),
                **options,
            )
            .remote()
            for rank in range(self.layout.world_size)
        ]

    def run(self, entry: Callable[..., Any], *args: Any) -> dict[int, Any]:
        """Run ``entry(context, *args)`` on every rank; return the values by rank.

        ``entry`` must be importable by name on the actors (a module-level function).

        Raises:
            GroupProcessError: a rank raised (its traceback is in the message), or the run
                overstayed ``timeout_s``; the ranks still running were killed.
        """
        if not self._actors:
            raise RuntimeError("RayJob.run() outside its with block")
        ray = _ray()
        deadline = deadline_after(self.timeout_s)
        trainer = self._actors[self.layout.trainer]
        rendezvous = self._get(
            trainer.rendezvous_address.remote(self.rendezvous_host),
            "the trainer's actor published no rendezvous address",
        )
        pending = {
            actor.run.remote(
                entry,
                JobContext(rank, self.layout, rendezvous, launcher="ray"),
                args,
                self.intra_op_threads,
            ): rank
            for rank, actor in enumerate(self._actors)
        }
        values: dict[int, Any] = {}
        failures: list[ChildFailure] = []
        give_up_at = deadline
        while pending:
            ready, _ = ray.wait(
                list(pending), num_returns=1, timeout=max(0.0, min(1.0, remaining(give_up_at)))
            )
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    status, value = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - an actor that died (killed, OOM)
                    status, value = "error", f"the actor died: {type(exc).__name__}: {exc}"
                if status == "ok":
                    values[rank] = value
                else:
                    failures.append(ChildFailure(rank, None, str(value)))
                    give_up_at = min(give_up_at, time.monotonic() + self.grace_s)
            if pending and time.monotonic() >= give_up_at:
                past_limit = not failures  # nothing failed before: the job's limit ran out
                for rank in pending.values():
                    ray.kill(self._actors[rank])
                    failures.append(
                        ChildFailure.overstayed(
                            rank,
                            past_limit=past_limit,
                            limit_s=self.timeout_s,
                            grace_s=self.grace_s,
                            group="job",
                        )
                    )
                pending.clear()
        if failures:
            raise GroupProcessError(failures, values, "RayJob")
        return values

    def _get(self, ref: Any, what: str) -> Any:
        """``ray.get(ref)`` within ``timeout_s``; running out fails every rank, saying ``what``."""
        ray = _ray()
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            why = f"{what} within {self.timeout_s:.1f} s"
            failures = [ChildFailure(r, None, why) for r in range(self.layout.world_size)]
            raise GroupProcessError(failures, {}, "RayJob") from None

    def _release(self) -> None:
        """Kill the actors, remove the placement group, stop a cluster this job started."""
        ray = _ray()
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        self._actors = []
        if self._placement is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._placement)
            except Exception:  # noqa: BLE001, S110 - the cluster is going away anyway
                pass
            self._placement = None
        if self.started_cluster:
            ray.shutdown()
            self.started_cluster = False
