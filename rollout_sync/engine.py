"""The engine contract: everything a rollout engine may provide to rollout_sync, in one place.

An engine is a :class:`~rollout_sync.RolloutBase` subclass. Two of its members are required
(``served_weights``, abstract; ``paused``, whose no-op default is right only for an engine whose
generation blocks the command loop), the rest are optional capabilities, each stated where it
is used (a method of the base class, or a ``runtime_checkable`` Protocol the engine meets by
having the members) and named here. This
module moves nothing: every name below is the very object of the module that states it, so an
engine may import it from either. :class:`EngineCapabilities` reads, from an engine's type alone,
which of them it provides. Adding an engine, file by file: docs/architecture.md.

**Required**

1. ``served_weights()`` (:meth:`RolloutBase.served_weights`, abstract). The tensors the
   engine's forwards read, by name, in a stable order. *Called by* the worker for every sync: an
   in-place receive writes into them (``SyncMode.SYNC``), an R2R source sends from them, a
   staging area (:class:`StagingArea`) and an async-mode weight buffer are cloned from them,
   and the default ``load_weights`` writes them. *Guarantees*: the names, shapes and dtypes
   never change while the engine serves; every incoming version is checked against them before
   any byte is written. An engine without writable tensors returns receive buffers of the right
   specs and overrides ``load_weights``.
2. ``paused(timeout)`` (:meth:`RolloutBase.paused`; what the guard needs of anything is
   :class:`SupportsPause`). Inside it no forward runs and none starts. *Called by* the bracket
   (:func:`~rollout_sync.weight_sync_bracket`, outermost) for every sync in ``SYNC`` mode and for
   the install alone in ``STAGED`` mode, and by :class:`~rollout_sync.backend.TornWeightsPark`,
   which keeps generation parked on torn weights. *Guarantees*: re-entrant; bounded by
   ``timeout``, raising :class:`~rollout_sync.errors.PauseTimeout` instead of hanging; always
   resumes on exit, exceptions included; a no-op before the engine exists. The default does
   nothing, which is right only for an engine whose ``generate`` blocks the loop that handles
   sync commands. :mod:`rollout_sync.testing.paused_contract` checks every clause.

**Optional, methods of RolloutBase** (the base's default in brackets)

3. ``initialize()`` / ``shutdown()`` [nothing]. Build the engine; release it. *Called by* the
   worker's first sync, inside its bracket, through ``ensure_initialized()`` (so an engine is
   built paused, with no payload in flight), at most once per instance whoever calls it.
4. ``load_weights(weights, require_all=)`` [copy in place into ``served_weights()``, every name,
   shape and dtype checked first]. *Called by* a staged install
   (:meth:`StagingArea.install_into`) and an async-mode install (:func:`install_inference_sync`),
   always with generation parked or on the generation thread. *Guarantees*: a bad input raises
   :class:`~rollout_sync.errors.WeightMismatchError` and writes nothing (a staged install that
   fails after that marks the engine torn). Override it for an engine with a reload path of
   its own.
5. The version and the torn state: ``weight_version``, ``commit_weight_version``,
   ``mark_weights_torn``, ``weights_torn``, ``check_servable`` [kept by the base]. *Called by*
   the worker after each transfer: commit on a complete version, mark torn on a write that
   failed part-way. *The engine's part*: refuse to generate while torn (``check_servable()``
   raises :class:`~rollout_sync.errors.TornWeightsError`), or be parked by its ``paused()``.
6. ``flat_weight_storage()`` [``None``]. The one ``uint8`` buffer the served weights are views
   of, laid out as :class:`FlatWeights` lays them out. *Called by* the worker, which hands it to
   every transfer (buckets received into and sent from it without copies), and by
   :meth:`StagingArea.of` (a flat staging copy). *Guarantees*: every byte of it, padding
   included, is the engine's to overwrite.
7. ``forward_collectives()`` [none]. The process-group backends (``"nccl"``, ``"gloo"``) the
   engine's forwards run collectives on (tensor parallelism). *Called by*
   :func:`check_two_communicators` when a worker is built (and for every adapter sync): a
   receive beside the forwards (staged, async, adapters) over NCCL is refused when this names
   NCCL. *Guarantees*: it names NCCL whenever the forwards use it.

**Optional, Protocols the engine meets by having the members**

8. :class:`BackgroundEngine` (``start()``, ``stop(timeout)``; :mod:`rollout_sync.worker`). An
   engine that generates on its own once started. *Called by* the worker: ``start`` after the
   first complete sync, inside its bracket (so it begins parked, with the new weights);
   ``stop`` in ``RolloutWorker.close``. A torn background engine is parked by the worker until
   a complete version lands. *Guarantees*: ``stop`` is bounded by its timeout.
9. :class:`SupportsWeightBuffer` (``attach_weight_buffer(buffer)``; :mod:`rollout_sync.buffer`).
   What the async modes need (``SyncMode.ASYNC_PER_GENERATION``, ``ASYNC_PER_FORWARD``): a
   worker in an async mode refuses, when built, an engine without it. *Called by* the worker's
   first async sync, once, with the :class:`~rollout_sync.WeightBuffer` it cloned from the
   served weights. *The engine's part*: call :func:`install_inference_sync` on its generation
   thread at its safe points (before each generation call, before each policy forward).
10. :class:`SupportsLoRA` (:mod:`rollout_sync.lora`). LoRA adapters served per request, each in
    a slot with a version of its own. *Called by* the worker for ``P2R(adapter=name)`` and
    ``R2R(adapter=name)`` (through :func:`~rollout_sync.lora.require_adapter`), always staged:
    it receives into a copy of ``served_adapter(name)``, installs it with ``load_adapter`` under
    a short pause and commits with ``commit_adapter_version``; an R2R source checks
    ``check_adapter_servable`` first. The engine's owner calls ``add_adapter`` before the first
    sync of an adapter.
11. Payload egress: :class:`SupportsHoldSends` (``hold_sends``, preferred) and
    :class:`SupportsFlushPendingSends` (``flush_pending_sends``) (:mod:`rollout_sync.egress`).
    Not the engine's own members as a rule: the components it ships rollouts through (the
    worker's ``data_packer`` and ``validation_packer``; the engine itself too, when it ships).
    *Called by* the bracket, through :func:`payload_egress_held`, for the whole sync: no send
    is in flight while a weight collective runs. *Guarantees*: ``hold_sends`` queues (never
    drops or reorders) what arrives while held.
12. :class:`KVCachePolicy` (:mod:`rollout_sync.backend`). An engine that keeps sequences in
    flight across a sync takes it explicitly: recompute their caches under the new weights,
    or keep the stale ones.

**Registered by name** (:mod:`rollout_sync.backends`): a job that runs replicas builds each
one's engine with a factory registered by :func:`register_engine`: it receives an
:class:`EngineRequest` (the job's config, the replica's timeline and payload sender) and returns
an :class:`EngineHandle` (the engine, its counters, a ``close``); the
:class:`RegisteredEngine` says what the job must know without building it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .backend import KVCachePolicy as KVCachePolicy
from .backend import RolloutBase as RolloutBase
from .backend import ThreadedRolloutBackend as ThreadedRolloutBackend
from .backends import EngineFactory as EngineFactory
from .backends import EngineHandle as EngineHandle
from .backends import EngineRequest as EngineRequest
from .backends import RegisteredEngine as RegisteredEngine
from .backends import register_engine as register_engine
from .buffer import SupportsWeightBuffer as SupportsWeightBuffer
from .buffer import install_inference_sync as install_inference_sync
from .egress import SupportsFlushPendingSends as SupportsFlushPendingSends
from .egress import SupportsHoldSends as SupportsHoldSends
from .egress import payload_egress_held as payload_egress_held
from .flat import FlatWeights as FlatWeights
from .guard import SupportsPause as SupportsPause
from .lora import SupportsLoRA as SupportsLoRA
from .staging import StagingArea as StagingArea
from .staging import check_two_communicators as check_two_communicators
from .sync.mode import SyncMode
from .sync.slot import BackgroundEngine as BackgroundEngine

__all__ = [
    "BackgroundEngine",
    "EngineCapabilities",
    "EngineFactory",
    "EngineHandle",
    "EngineRequest",
    "FlatWeights",
    "KVCachePolicy",
    "RegisteredEngine",
    "RolloutBase",
    "StagingArea",
    "SupportsFlushPendingSends",
    "SupportsHoldSends",
    "SupportsLoRA",
    "SupportsPause",
    "SupportsWeightBuffer",
    "ThreadedRolloutBackend",
    "check_two_communicators",
    "install_inference_sync",
    "payload_egress_held",
    "register_engine",
]


@dataclass(frozen=True)
class EngineCapabilities:
    """Which optional parts of the contract an engine provides, read from its type alone: nothing
    is called and nothing is built, so it is safe on an engine that does not exist yet.

    An overridden method says the engine provides its own version of it, not what that version
    returns (``flat_weight_storage()`` may still return ``None``).
    """

    engine: str
    """The engine's class name."""
    parks: bool
    """Overrides ``paused()``: its generation really parks (the default is a no-op)."""
    loads: bool
    """Overrides ``load_weights()`` (a reload path of its own)."""
    flat_storage: bool
    """Overrides ``flat_weight_storage()``."""
    forward_collectives: bool
    """Overrides ``forward_collectives()``."""
    background: bool
    """A :class:`BackgroundEngine`: generates on its own once started."""
    weight_buffer: bool
    """A :class:`SupportsWeightBuffer`: runs the async modes."""
    lora: bool
    """A :class:`SupportsLoRA`: serves LoRA adapters."""

    @classmethod
    def of(cls, rollout: RolloutBase) -> EngineCapabilities:
        """What ``rollout`` provides.

        Raises:
            TypeError: ``rollout`` is not a :class:`RolloutBase` (every engine subclasses it).
        """
        if not isinstance(rollout, RolloutBase):
            raise TypeError(
                f"{type(rollout).__name__} is not an engine: an engine subclasses "
                "rollout_sync.RolloutBase (see rollout_sync.engine)"
            )
        kind = type(rollout)
        return cls(
            engine=kind.__name__,
            parks=kind.paused is not RolloutBase.paused,
            loads=kind.load_weights is not RolloutBase.load_weights,
            flat_storage=kind.flat_weight_storage is not RolloutBase.flat_weight_storage,
            forward_collectives=kind.forward_collectives is not RolloutBase.forward_collectives,
            background=isinstance(rollout, BackgroundEngine),
            weight_buffer=isinstance(rollout, SupportsWeightBuffer),
            lora=isinstance(rollout, SupportsLoRA),
        )

    @property
    def sync_modes(self) -> frozenset[SyncMode]:
        """The sync modes a :class:`~rollout_sync.RolloutWorker` runs this engine in: ``SYNC``
        and ``STAGED`` always, the async modes with a weight buffer."""
        modes = {SyncMode.SYNC, SyncMode.STAGED}
        if self.weight_buffer:
            modes |= {SyncMode.ASYNC_PER_GENERATION, SyncMode.ASYNC_PER_FORWARD}
        return frozenset(modes)

    def __repr__(self) -> str:
        provided = [
            label
            for label, has in (
                ("parks", self.parks),
                ("loads", self.loads),
                ("flat storage", self.flat_storage),
                ("forward collectives", self.forward_collectives),
                ("background", self.background),
                ("weight buffer", self.weight_buffer),
                ("lora", self.lora),
            )
            if has
        ]
        modes = ", ".join(sorted(m.value for m in self.sync_modes))
        return (
            f"<EngineCapabilities {self.engine}: {', '.join(provided) or 'required only'}; {modes}>"
        )
