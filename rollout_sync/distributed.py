"""Process groups and collectives with timeouts: rendezvous, sub-groups, bounded waits.

Every rendezvous and every collective in rollout_sync has a timeout in seconds. Rendezvous is
torch.distributed's own: ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``) or a ``tcp://host:port`` address, so the same code runs on one machine over
loopback and on several machines.

* :func:`init_process_group` / :func:`new_group` - the torch.distributed calls, with a timeout
  that bounds the rendezvous *and* becomes the group's default collective timeout.
* :func:`wait_work` - wait for an ``async_op=True`` work handle for at most ``timeout_s``
  seconds, turning a timeout into :class:`~rollout_sync.errors.CollectiveTimeout` and a dead
  peer into :class:`~rollout_sync.errors.CollectiveError`, both naming the operation.
* :func:`group_ranks` - the global ranks of a group, for messages.
* :class:`GroupCollectives` - broadcast and all-gather on either kind of group: one registered
  with the default group (global ranks, ``torch.distributed`` calls) or a *standalone* one,
  made outside it (vLLM's ``stateless_init_torch_distributed_process_group``: group ranks,
  methods of the group object). :func:`standalone_group` makes one (gloo or NCCL, no default
  group needed); :func:`adopt_group` gives one made elsewhere its timeout.
* :func:`find_free_port` - a TCP port nothing listens on now, for a rendezvous a process hosts
  (a launcher's trainer, a loopback test).

Spawning processes of one's own (tests, demos, benchmarks) is
:func:`rollout_sync.testing.run_processes`.
"""

from __future__ import annotations

import socket
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BroadcastOptions

from ._deadline import group_timedelta, wait_collective
from ._group_abort import GroupAbort
from .errors import CollectiveError, CollectiveTimeout

__all__ = [
    "CollectiveError",
    "CollectiveTimeout",
    "GroupCollectives",
    "adopt_group",
    "find_free_port",
    "group_ranks",
    "group_timeout_s",
    "init_process_group",
    "new_group",
    "standalone_group",
    "wait_work",
]

DEFAULT_GROUP_TIMEOUT_S = 60.0

_GROUP_TIMEOUTS: weakref.WeakKeyDictionary[dist.ProcessGroup, float] = weakref.WeakKeyDictionary()
"""The timeout each group was made with here: the backend ends an operation there, whatever
longer limit a caller waits with."""


_GROUP_STORES: weakref.WeakKeyDictionary[dist.ProcessGroup, Any] = weakref.WeakKeyDictionary()


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on at the time of the call.

    Another process may take it before it is used; a rendezvous hosted right after the call (a
    launcher's trainer, a loopback test) is the intended use, where that race is rare enough.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def init_process_group(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str = "env://",
    backend: str = "gloo",
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
) -> None:
    """Join the default process group; bounded by ``timeout_s`` seconds.

    ``init_method`` is ``env://`` (rank and world size may then come from ``RANK`` and
    ``WORLD_SIZE``) or ``tcp://host:port``. ``timeout_s`` bounds the rendezvous and is the
    default limit of every collective on the group (gloo and NCCL both honour it).

    Raises:
        RuntimeError (from torch.distributed): the rendezvous did not complete in time, or the
        process already belongs to a default group.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "init_process_group: this process already joined a default process group; "
            "call torch.distributed.destroy_process_group() first"
        )
    kwargs: dict[str, Any] = {}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    dist.init_process_group(
        backend, init_method=init_method, timeout=group_timedelta(timeout_s), **kwargs
    )
    _GROUP_TIMEOUTS[dist.distributed_c10d._get_default_group()] = timeout_s


def new_group(
    ranks: Sequence[int],
    *,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    backend: str | None = None,
) -> dist.ProcessGroup:
    """A sub-group of ``ranks`` (global ranks) whose collectives default to ``timeout_s``.

    Every rank of the default group must call this, with the same ``ranks``, in the same order
    as every other ``new_group`` call (torch.distributed's rule). A rank outside ``ranks`` gets
    a placeholder it must not use.
    """
    group: dist.ProcessGroup | None = dist.new_group(
        sorted(ranks), timeout=group_timedelta(timeout_s), backend=backend
    )
    if group is None:  # pragma: no cover - torch returns a placeholder, not None, today
        raise RuntimeError(f"new_group({list(ranks)}) returned no group")
    if isinstance(group, dist.ProcessGroup):  # not the placeholder of a non-member
        _GROUP_TIMEOUTS[group] = timeout_s
    return group


def group_timeout_s(group: dist.ProcessGroup | None) -> float | None:
    """The timeout ``group`` (``None``: the default group) was made with by
    :func:`init_process_group` / :func:`new_group`; ``None`` for a group made elsewhere."""
    if group is None or group is dist.group.WORLD:
        if not dist.is_initialized():
            return None
        group = dist.distributed_c10d._get_default_group()
    return _GROUP_TIMEOUTS.get(group)


def standalone_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    prefix: str = "rollout_sync",
) -> dist.ProcessGroup:
    """A process group of its own, outside the default group (which may not exist, or belong
    to someone else: vLLM's workers have one of world size 1): ranks ``0 .. world_size - 1``.

    Rank 0 hosts the rendezvous store on ``host:port``; every member calls this with the same
    address, world size and backend. ``timeout_s`` bounds the rendezvous and every collective.
    Use it through :class:`GroupCollectives` (or a :class:`~rollout_sync.transfer.WeightTransfer`,
    which does). ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).

    Raises:
        ValueError: an unknown backend.
        RuntimeError / DistStoreError (from torch.distributed): the rendezvous did not complete
        within ``timeout_s``.
    """
    timeout = group_timedelta(timeout_s)
    rendezvous: Any = dist.rendezvous  # type: ignore[attr-defined]
    store, _, _ = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix_store = dist.PrefixStore(f"{prefix}/{host}:{port}", store)  # type: ignore[attr-defined]
    group = dist.ProcessGroup(prefix_store, rank, world_size)
    if backend == "gloo":
        backend_type = dist.ProcessGroup.BackendType.GLOO
        impl: Any = dist.ProcessGroupGloo(prefix_store, rank, world_size, timeout)
        device = torch.device("cpu")
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend_type = dist.ProcessGroup.BackendType.NCCL
        impl = dist.ProcessGroupNCCL(prefix_store, rank, world_size, options)
        device = torch.device("cuda")
    else:
        raise ValueError(f"standalone_group: backend must be 'gloo' or 'nccl', got {backend!r}")
    group._set_default_backend(backend_type)
    impl._set_sequence_number_for_group()
    group._register_backend(device, backend_type, impl)
    # Keep the store alive with the group: rank 0's hosts the rendezvous.
    _GROUP_STORES[group] = store
    GroupAbort.register_store(group, prefix_store)
    return adopt_group(group, timeout_s)


def adopt_group(group: dist.ProcessGroup, timeout_s: float) -> dist.ProcessGroup:
    """Record ``timeout_s`` as the limit ``group``'s backend was made with (a group made
    elsewhere, e.g. a standalone one), so :func:`wait_work` bounds its waits by it."""
    _GROUP_TIMEOUTS[group] = timeout_s
    return group


def is_standalone(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` was made outside the default group (torch does not know its global
    ranks): its collectives are methods of the group object, on group ranks."""
    if group is None or group is dist.group.WORLD:
        return False
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):
        return True
    return False


class _FailedStart(dist.Work):
    """The work of an operation that could not even start (a group a dead peer broke refuses
    new work with gloo's raw ``RuntimeError``): complete at once, and its wait raises that
    error, so it reaches the caller where every failure of the operation does, at its wait,
    through the same translation into the package's errors."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    def wait(self, timeout: Any = None) -> bool:
        raise self.error

    def is_completed(self) -> bool:
        return True


class GroupCollectives:
    """The collectives a transfer needs, on a registered or a standalone group.

    Ranks are in the group's own numbering as :func:`group_ranks` gives it: global ranks for a
    group registered with the default group, group ranks ``0 .. size - 1`` for a standalone
    one (whose members need no default group at all, or are in a different one: inside a vLLM
    worker the default group is vLLM's own). ``rank`` is this process's rank in that numbering.
    Every operation starts the collective (or the point-to-point send or receive) and returns
    its work handle (``async_op``). An operation that cannot start (the group is broken) does
    not raise here: its work's wait raises the backend's error, so a caller handles every
    failure in one place, its wait (:func:`wait_work`).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.standalone = is_standalone(group)
        self.ranks = group_ranks(group)
        if self.standalone:
            assert group is not None
            self.rank = group.rank()
            self.backend = str(group.name()).lower()
        else:
            self.rank = dist.get_rank()
            self.backend = str(dist.get_backend(group)).lower()

    def broadcast(self, tensor: torch.Tensor, src: int) -> dist.Work:
        """Start broadcasting ``tensor`` from ``src`` (a rank in this group's numbering)."""
        if self.standalone:
            assert self.group is not None
            options = BroadcastOptions()
            options.rootRank = src
            return self._start(lambda: self.group.broadcast([tensor], options))  # type: ignore[union-attr]
        return self._start(lambda: dist.broadcast(tensor, src, group=self.group, async_op=True))

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> dist.Work:
        """Start gathering every member's ``tensor`` into ``outputs`` (in rank order)."""
        if self.standalone:
            assert self.group is not None
            return self._start(lambda: self.group.allgather([outputs], [tensor]))  # type: ignore[union-attr]
        return self._start(
            lambda: dist.all_gather(outputs, tensor, group=self.group, async_op=True)
        )

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        """Start sending ``tensor`` to ``dst``, matched by the ``recv`` of the same ``tag``."""
        if self.standalone:
            assert self.group is not None
            return self._start(lambda: self.group.send([tensor], dst, tag))  # type: ignore[union-attr]
        return self._start(lambda: dist.isend(tensor, dst=dst, group=self.group, tag=tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        """Start receiving into ``tensor`` what ``src`` sends with ``tag``."""
        if self.standalone:
            assert self.group is not None
            return self._start(lambda: self.group.recv([tensor], src, tag))  # type: ignore[union-attr]
        return self._start(lambda: dist.irecv(tensor, src=src, group=self.group, tag=tag))

    @staticmethod
    def _start(launch: Callable[[], dist.Work | None]) -> dist.Work:
        try:
            work = launch()
        except RuntimeError as exc:  # a broken group refuses new work: raised at the wait
            return _FailedStart(exc)
        assert work is not None
        return work


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (``None``: the default group), in group-rank order.

    A group torch does not know by its global ranks (one made outside ``init_process_group``,
    as vLLM's stateless groups are) is described by its group ranks ``0 .. size - 1``.
    """
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (KeyError, RuntimeError, ValueError):
        return tuple(range(group.size()))


def wait_work(
    work: dist.Work | None,
    *,
    operation: str,
    timeout_s: float,
    group: dist.ProcessGroup | None = None,
    ranks: Sequence[int] | None = None,
) -> None:
    """Wait at most ``timeout_s`` seconds for an ``async_op=True`` collective to complete.

    The backend ends the operation at the group's own timeout, so the wait is bounded by the
    shorter of the two, and a failure at that point is a timeout, not a dead peer. ``ranks``:
    the group's global ranks, if the caller has them (else looked up, for messages).

    Raises:
        CollectiveTimeout: it did not complete in time (a peer hung or never joined).
        CollectiveError: the backend reported a failure before the limit (typically a peer that
            died: its connection closed), or another rank of the group did and said so on the
            group's abort flag (:mod:`rollout_sync._group_abort`: every rank of a group whose
            store this process reaches fails within a poll of the first failure, not at its
            limit). Both name ``operation`` and the group; the group should be considered
            broken afterwards.
    """
    limit = timeout_s
    own = group_timeout_s(group)
    if own is not None and own < limit:
        limit = own
    members = ranks if ranks is not None else group_ranks(group)
    abort = GroupAbort.of(group)
    wait_collective([work], operation=operation, timeout_s=limit, ranks=members, abort=abort)
