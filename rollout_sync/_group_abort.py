"""A group's abort flag: one rank that saw a collective fail tells every rank of the group.

A rank whose peer died learns of it at once (the peer's connection closed), but only the ranks
that talk to that peer directly do. The others are left in an operation the group can no longer
complete: a send to a rank that stopped receiving, a receive from a rank that stopped sending,
the commit vote of a rank that gave up. Gloo work cannot be cancelled, so without help they
wait out the whole limit.

:class:`GroupAbort` is the help: a key on the group's own rendezvous store (outside the broken
group's connections), set by the first rank whose wait failed and read by every wait of the
group (:func:`~rollout_sync._deadline.wait_collective`), so every rank of the group fails
within a poll of the first failure instead of at its limit.

Rules, in order of importance:

1. **A posted abort is final for the group.** A group with a failed collective is unusable (its
   ranks no longer agree on which operation comes next); the recovery builds new groups on a
   new rendezvous (:mod:`rollout_sync.recovery`) and never reuses it. So the flag is never
   cleared.
2. **The flag never makes anything worse.** Posting and reading swallow every store error (the
   store's host may be the process that died): without a store, waits end at their limit as
   before.
3. **Reading is cheap and never blocks**: one ``check`` on the store per poll.

Private: :func:`rollout_sync.distributed.wait_work` reads the flag of the group it waits on.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["GroupAbort"]

ABORT_KEY = "rollout_sync/group_aborted"

_CACHE: weakref.WeakKeyDictionary[Any, GroupAbort | None] = weakref.WeakKeyDictionary()
_STANDALONE_STORES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class GroupAbort:
    """The abort flag of one process group, on ``store`` (the group's rendezvous store).

    ``backend`` is the group's: waits on gloo poll the flag while they wait, waits on NCCL read
    it before each wait (a CUDA work is waited for on the caller's thread and stream).
    """

    def __init__(self, store: Any, backend: str) -> None:
        self.store = store
        self.backend = backend
        self._reason: str | None = None
        self._reachable = True

    def __repr__(self) -> str:
        state = "aborted" if self._reason is not None else "open"
        return f"<GroupAbort {self.backend} {state}>"

    @classmethod
    def of(cls, group: Any) -> GroupAbort | None:
        """The flag of ``group`` (``None``: the default group), or ``None`` for a group whose
        store this process cannot reach (one made elsewhere, not adopted with its store)."""
        if group is None or group is dist.group.WORLD:
            if not dist.is_initialized():
                return None
            group = dist.distributed_c10d._get_default_group()
        try:
            return _CACHE[group]
        except KeyError:
            pass
        except TypeError:  # not weak-referenceable: no cache
            return cls._build(group)
        flag = cls._build(group)
        _CACHE[group] = flag
        return flag

    @classmethod
    def _build(cls, group: Any) -> GroupAbort | None:
        store = _STANDALONE_STORES.get(group)
        if store is None:
            try:
                store = dist.distributed_c10d._get_process_group_store(group)
                backend = str(dist.get_backend(group)).lower()
            except (KeyError, RuntimeError, ValueError):
                return None
        else:
            backend = str(group.name()).lower()
        return cls(store, backend)

    @staticmethod
    def register_store(group: Any, store: Any) -> None:
        """Give a standalone group (made outside the default group) the store its flag lives on."""
        _STANDALONE_STORES[group] = store
        _CACHE.pop(group, None)

    def post(self, reason: str) -> None:
        """Tell every rank of the group that it is broken, and why (first poster's reason kept
        locally; a store error is swallowed: rule 2)."""
        if self._reason is None:
            self._reason = reason
        try:
            self.store.compare_set(ABORT_KEY, "", reason)
        except Exception:  # noqa: BLE001 - rule 2: no store, no abort, waits end at their limit
            self._reachable = False

    def seen(self) -> str | None:
        """The reason, if this process has posted or read it already (no store access)."""
        return self._reason

    def reason(self) -> str | None:
        """Why the group was aborted, if a rank has said so; ``None`` otherwise. Never blocks
        for long: a ``check`` on the store, then a ``get`` only once the key exists."""
        if self._reason is not None:
            return self._reason
        if not self._reachable:
            return None
        try:
            if not self.store.check([ABORT_KEY]):
                return None
            self._reason = bytes(self.store.get(ABORT_KEY)).decode(errors="replace")
        except Exception:  # noqa: BLE001 - rule 2: a store gone (its host died) reads as open
            self._reachable = False
            return None
        return self._reason
