"""Launcher-neutral pieces of a job: who is who by rank, the rendezvous, commands across hosts.

A job is one trainer and N rollout replicas, one process each (or, sharded, a trainer of
several ranks and replicas of several ranks each), placed by whatever launches them:
``multiprocessing`` on one host, ``torchrun`` across nodes, Ray actors. Whatever the launcher,
every process runs the same entry point with a :class:`JobContext`:

* :class:`JobLayout` - the ranks: the trainer (rank 0 by default) and the replicas (the
  others, in rank order; the first receives P2R and is the R2R source, as in
  :func:`~rollout_sync.build_sync_groups`); sharded, the trainer's ranks first, then each
  replica's (:meth:`JobLayout.sharded`, as in
  :func:`~rollout_sync.sharded_groups.build_sharded_sync_groups`).
* :class:`JobContext` - this process's rank, the layout and the *rendezvous*: ``env://`` under
  torchrun (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), or a
  ``tcp://host:port`` address the launcher gives (Ray: the trainer actor publishes it).
  :meth:`JobContext.join` joins the default process group.
* :class:`StoreCommandQueue` - a replica's command queue on the job's rendezvous store (the
  store every rank reached to join), so the trainer's
  :class:`~rollout_sync.WorkerCommandChannel` reaches :class:`~rollout_sync.RolloutWorker` s on
  other hosts with no queue shared in memory and no extra port.
  :meth:`JobContext.command_queues` gives them.

The launchers themselves are this module's siblings: :mod:`rollout_sync.launch.torchrun` and
:mod:`rollout_sync.launch.ray`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import queue
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import torch.distributed as dist

from ..distributed import DEFAULT_GROUP_TIMEOUT_S, init_process_group
from ..errors import RolloutSyncError, ShutdownTimeout
from ..worker import P2R, R2R, Stop

__all__ = [
    "JobContext",
    "JobLayout",
    "QueueStore",
    "Role",
    "StoreCommandQueue",
    "command_queues",
    "results_on_trainer",
]


class Role(enum.Enum):
    """What a process of the job does."""

    TRAINER = "trainer"
    REPLICA = "replica"


@dataclass(frozen=True)
class JobLayout:
    """The ranks of a job: a trainer and rollout replicas.

    The plain job (the defaults) is one trainer process and ``world_size - 1`` replicas of one
    process each. A *sharded* job has a trainer of ``trainer_ranks`` processes (an FSDP-style
    trainer, each rank holding its shards) and replicas of ``replica_size`` processes each (a
    tensor-parallel engine): ranks ``trainer .. trainer + trainer_ranks - 1`` are the trainer's,
    and the others, in rank order, are cut into consecutive replicas of ``replica_size`` ranks
    (with ``trainer = 0``: replica ``j`` is ranks ``trainer_ranks + j * replica_size ..
    trainer_ranks + (j + 1) * replica_size - 1``). :meth:`sharded` builds one from its counts.

    Args:
        world_size: processes in the job (at least 2).
        trainer: the trainer's (first) global rank; with several trainer ranks, the one that
            hosts the rendezvous, announces the syncs and gathers results.
        trainer_ranks: processes of the trainer (at least 1).
        replica_size: processes of each replica (at least 1); ``world_size - trainer_ranks``
            must be a positive multiple of it.
    """

    world_size: int
    trainer: int = 0
    trainer_ranks: int = 1
    replica_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(
                f"a job needs a trainer and at least one replica, got world_size={self.world_size}"
            )
        if not 0 <= self.trainer < self.world_size:
            raise ValueError(f"trainer rank {self.trainer} is not in 0..{self.world_size - 1}")
        if self.trainer_ranks < 1 or self.replica_size < 1:
            raise ValueError(
                f"a job needs at least one trainer rank and one rank per replica, got "
                f"trainer_ranks={self.trainer_ranks}, replica_size={self.replica_size}"
            )
        if self.trainer + self.trainer_ranks > self.world_size:
            raise ValueError(
                f"trainer ranks {self.trainer}..{self.trainer + self.trainer_ranks - 1} do not "
                f"fit in a job of {self.world_size} processes"
            )
        rest = self.world_size - self.trainer_ranks
        if rest < self.replica_size or rest % self.replica_size:
            raise ValueError(
                f"{rest} replica process(es) (world_size {self.world_size} - "
                f"{self.trainer_ranks} trainer rank(s)) do not make whole replicas of "
                f"{self.replica_size} rank(s) each"
            )

    @classmethod
    def sharded(cls, trainer_ranks: int, replicas: int, replica_size: int) -> JobLayout:
        """Trainer ranks ``0 .. trainer_ranks - 1``, then ``replicas`` replicas of
        ``replica_size`` consecutive ranks each."""
        return cls(
            trainer_ranks + replicas * replica_size,
            trainer_ranks=trainer_ranks,
            replica_size=replica_size,
        )

    @property
    def is_sharded(self) -> bool:
        """Several trainer ranks, or replicas of several ranks."""
        return self.trainer_ranks > 1 or self.replica_size > 1

    @property
    def trainers(self) -> tuple[int, ...]:
        """The trainer's ranks, in its layout's order (``(trainer,)`` for a plain job)."""
        return tuple(range(self.trainer, self.trainer + self.trainer_ranks))

    @property
    def replicas(self) -> tuple[int, ...]:
        """Every replica rank in rank order. In a plain job each is a replica; the first is the
        P2R target and the R2R source. In a sharded job see :attr:`replica_groups`."""
        trainers = self.trainers
        return tuple(r for r in range(self.world_size) if r not in trainers)

    @property
    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """Each replica's ranks, in replica order (the first receives P2R); within one, in its
        tensor-parallel order (the first is the replica's leader)."""
        ranks, size = self.replicas, self.replica_size
        return tuple(ranks[i : i + size] for i in range(0, len(ranks), size))

    @property
    def leaders(self) -> tuple[int, ...]:
        """The first rank of each replica (the one that schedules and ships payloads)."""
        return tuple(group[0] for group in self.replica_groups)

    @property
    def num_replicas(self) -> int:
        return (self.world_size - self.trainer_ranks) // self.replica_size

    def role_of(self, rank: int) -> Role:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        return Role.TRAINER if rank in self.trainers else Role.REPLICA

    def describe(self) -> str:
        """In words: ``"2 trainer ranks, 3 replicas x 2 ranks (8 processes)"``."""
        trainer = (
            "1 trainer rank" if self.trainer_ranks == 1 else f"{self.trainer_ranks} trainer ranks"
        )
        n = self.num_replicas
        replicas = f"{n} replica{'s' if n != 1 else ''}"
        if self.replica_size > 1:
            replicas += f" x {self.replica_size} ranks"
        return f"{trainer}, {replicas} ({self.world_size} processes)"


@dataclass(frozen=True)
class JobContext:
    """What one process of a job knows: its rank, the layout, and where to rendezvous.

    Launchers build it; the entry point of every process takes it, whatever the launcher.
    """

    rank: int
    layout: JobLayout
    rendezvous: str
    """``env://`` (torchrun) or ``tcp://host:port`` (hosted by the trainer's rank)."""
    launcher: str = "local"
    """Who placed the processes, for reports: ``local``, ``torchrun``, ``ray``, ..."""

    @property
    def role(self) -> Role:
        return self.layout.role_of(self.rank)

    @property
    def is_trainer(self) -> bool:
        return self.role is Role.TRAINER

    def join(self, *, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S, backend: str = "gloo") -> None:
        """Join the job's default process group (bounded by ``timeout_s``, which is also the
        group's collective limit).

        Raises:
            RuntimeError (from torch.distributed): the rendezvous did not complete in time.
        """
        init_process_group(
            rank=self.rank,
            world_size=self.layout.world_size,
            init_method=self.rendezvous,
            timeout_s=timeout_s,
            backend=backend,
        )

    def command_queues(self) -> dict[int, StoreCommandQueue]:
        """The replicas' command queues on the job's store, by replica rank (after :meth:`join`).

        On the trainer: every replica rank's (in a sharded job each rank of a replica runs a
        worker of its own), to put commands on (a :class:`~rollout_sync.WorkerCommandChannel`
        takes them; with several trainer ranks, the one that announces). On a replica: its own,
        to take commands from (``RolloutWorker(commands=...)``); :meth:`StoreCommandQueue.close`
        it when done. Call once per process: each call makes new queue objects on the same store
        keys.
        """
        return command_queues(self.layout.replicas if self.is_trainer else (self.rank,))


def command_queues(replicas: Iterable[int]) -> dict[int, StoreCommandQueue]:
    """Command queues of ``replicas`` on the store of the default group as it is now, by
    replica rank.

    After :func:`~rollout_sync.recovery.rejoin` that is the new job's store: the trainer makes
    every replica's (for its new :class:`~rollout_sync.WorkerCommandChannel`), each replica its
    own (its worker's new ``commands``). Queues on the old store are useless then (every
    ``get`` raises once that store is gone); :meth:`StoreCommandQueue.close` them.

    Raises:
        RuntimeError: no default group (join the job, or rejoin, first).
    """
    store = _job_store()
    return {rank: StoreCommandQueue(store, rank) for rank in replicas}


# -- commands across hosts ---------------------------------------------------------------------

_COMMANDS: Mapping[str, type] = {"P2R": P2R, "R2R": R2R, "Stop": Stop}
_CLOSE = b'{"kind": "_close"}'


def _encode(command: object) -> bytes:
    kind = type(command).__name__
    if _COMMANDS.get(kind) is not type(command):
        raise TypeError(
            f"a StoreCommandQueue carries P2R, R2R and Stop commands, not {kind}; put other "
            "commands on a queue of your own"
        )
    assert dataclasses.is_dataclass(command)
    fields = {f.name: getattr(command, f.name) for f in dataclasses.fields(command)}
    return json.dumps({"kind": kind, **fields}).encode()


def _decode(data: bytes) -> object:
    doc = json.loads(data.decode())
    cls = _COMMANDS[doc.pop("kind")]
    return cls(**doc)


class QueueStore(Protocol):
    """The part of a ``torch.distributed`` store a command queue uses (``TCPStore`` has it)."""

    def queue_push(self, key: str, value: bytes) -> None: ...

    def queue_pop(self, key: str, block: bool = True) -> bytes: ...

    def clone(self) -> QueueStore: ...

    def set_timeout(self, timeout: timedelta) -> None: ...


def _job_store() -> QueueStore:
    """The store of the default group's rendezvous."""
    if not dist.is_initialized():
        raise RuntimeError("join the job's process group first (JobContext.join)")
    # Private in torch, and stable since 1.x: the store every rank already reached to join, so
    # commands need no extra port and cross hosts wherever the rendezvous does. (Keys carry our
    # prefix themselves: torch's PrefixStore does not prefix queue keys consistently.)
    store = dist.distributed_c10d._get_default_store()
    return cast(QueueStore, store)  # torch's stubs lack Store.clone, which every store has


class StoreCommandQueue:
    """A replica's command queue on a ``torch.distributed`` store: put on one host, get on
    another.

    Both :class:`~rollout_sync.worker.CommandSink` (``put``, the trainer's side: a store
    ``queue_push``, never blocks) and :class:`~rollout_sync.worker.CommandSource` (``get``, the
    replica's side). The consumer's first ``get`` starts a reader thread that waits on the
    store (a blocking pop, woken by the push, so a command costs no polling delay) and hands
    commands over in order. If the store goes away (the trainer's process died and took it with
    it), every later ``get`` raises at once. Carries :class:`~rollout_sync.P2R`,
    :class:`~rollout_sync.R2R` and :class:`~rollout_sync.Stop`.

    Args:
        store: a store every process of the job reaches (see :meth:`JobContext.command_queues`).
        rank: the replica whose queue this is.
        wait_s: how long the reader's blocking pop waits before it asks again (the store logs a
            line when a wait runs out; nothing is lost).
    """

    def __init__(self, store: QueueStore, rank: int, *, wait_s: float = 60.0) -> None:
        self.rank = rank
        self.key = f"rollout_sync/commands/replica_{rank}"
        self._store = store
        self._wait_s = wait_s
        self._taken: queue.Queue[object] = queue.Queue()
        self._reader: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "reading" if self._reader else "idle"
        return f"<StoreCommandQueue replica {self.rank} {state}: {self._taken.qsize()} waiting>"

    def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
        """Queue ``item`` for the replica (the store's queue is unbounded: never blocks).

        Raises:
            TypeError: ``item`` is not a P2R, R2R or Stop command.
        """
        self._store.queue_push(self.key, _encode(item))

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        """The next command, waiting at most ``timeout`` seconds (``None``: for ever).

        Raises:
            queue.Empty: none arrived in time.
            RolloutSyncError: the store is gone (the trainer's process died); chained.
        """
        self._start_reader()
        item = self._taken.get(block, timeout)  # raises queue.Empty
        if item is _FAILED:
            self._taken.put(_FAILED)  # every later get fails at once too
            raise RolloutSyncError(
                f"the command queue of replica {self.rank} failed: the job's store is gone "
                f"(the trainer's process most likely died): {self._error}"
            ) from self._error
        return item

    def close(self, timeout: float = 5.0) -> None:
        """Stop the reader thread (bounded by ``timeout``); commands not taken stay in the store.

        Raises:
            ShutdownTimeout: the reader did not stop in time (the store stopped answering).
        """
        reader = self._reader
        if reader is None or not reader.is_alive():
            return
        try:
            self._store.queue_push(self.key, _CLOSE)
        except RuntimeError:
            return  # the store is gone, and with it the reader's pop
        reader.join(timeout)
        if reader.is_alive():
            raise ShutdownTimeout(
                f"the command reader of replica {self.rank} did not stop within {timeout:.1f} s"
            )

    def _start_reader(self) -> None:
        with self._lock:
            if self._reader is None:
                self._reader = threading.Thread(
                    target=self._read, name=f"commands-replica-{self.rank}", daemon=True
                )
                self._reader.start()

    def _read(self) -> None:
        # A connection of its own, so its timeout is not the process group's.
        store = self._store.clone()
        store.set_timeout(timedelta(seconds=self._wait_s))
        try:
            while True:
                try:
                    data = store.queue_pop(self.key, True)
                except dist.DistNetworkError:
                    raise  # the store is gone
                except dist.DistStoreError:
                    continue  # the wait ran out (the store raises timeouts as this type)
                if data == _CLOSE:
                    return
                self._taken.put(_decode(data))
        except BaseException as exc:  # noqa: BLE001 - raised to the consumer by get()
            self._error = exc
            self._taken.put(_FAILED)


_FAILED = object()


def results_on_trainer(context: JobContext, value: Any) -> dict[int, Any] | None:
    """Gather every rank's ``value`` on the trainer (a collective on the default group).

    For launchers with no parent process to collect results (torchrun): every rank calls it
    with its result; the trainer (its rank ``layout.trainer``, with several trainer ranks) gets
    ``{rank: value}``, the others ``None``.
    """
    # Only the gathering rank passes a list (a sharded trainer's other ranks are trainers too).
    gathering = context.rank == context.layout.trainer
    gathered: list[Any] | None = [None] * context.layout.world_size if gathering else None
    dist.gather_object(value, gathered, dst=context.layout.trainer)
    if gathered is None:
        return None
    return dict(enumerate(gathered))
