"""Rollout engines behind :class:`~rollout_sync.RolloutBase`, and the registry that names them.

Each backend lives in its own module; import its names from there.

* :mod:`rollout_sync.backends.torch_lm` - the embedded default: a tiny causal LM in plain torch,
  blocking (:class:`~rollout_sync.backends.torch_lm.TorchLMBackend`) and streaming on the
  scheduler (:class:`~rollout_sync.backends.torch_lm.TorchLMStreamBackend`).
* :mod:`rollout_sync.backends.vllm` - vLLM (``pip install 'rollout-sync[vllm]'``), with its
  engine-side worker extension in :mod:`rollout_sync.backends.vllm.worker`. It imports vLLM
  lazily, so ``import rollout_sync`` works without it.

What an engine may provide to rollout_sync is stated in one place, :mod:`rollout_sync.engine`.

**The registry.** A job of rollout replicas (``rollout-sync demo --backend NAME``) builds each
replica's engine by name: :func:`register_engine` adds a name, :func:`registered_engine` (the
whole registration), :func:`engine_factory` (its factory alone) and :func:`registered_engines`
(every name) look it up, :func:`unregister_engine` takes one away. An unknown name is a
:class:`KeyError` that lists the registered names.

* **A factory** (:data:`EngineFactory`) receives one :class:`EngineRequest`: ``config``, the
  job's configuration (the demo's is a
  :class:`~rollout_sync.demos.job.DistributedDemoConfig`; the factory reads the fields it
  needs), ``timeline``, the replica process's :class:`~rollout_sync.trace.Timeline` (record the
  engine's forwards and weight writes in it), and ``sender``, the replica's
  :class:`~rollout_sync.PayloadSender` (ship every finished generation through it). It runs in
  the replica's process, once, before the replica's :class:`~rollout_sync.RolloutWorker` exists
  (the default process group is up: ``torch.distributed.get_rank()`` is the replica's rank). It
  returns an :class:`EngineHandle`: the engine, a :class:`~rollout_sync.RolloutBase` that is
  not started (a :class:`~rollout_sync.worker.BackgroundEngine` is started by the worker
  inside the first sync); ``counters``, read once after the run; ``close``, called last.
* **A registration** (:class:`RegisteredEngine`) carries, besides the factory, what a job needs
  to know without building the engine: the sync modes it runs, how long it takes to start,
  whether it starts processes of its own, the default replica count, the launchers that can
  place it, what it needs installed (``requires``), the trainer's weights in the engine's
  names (``trainer_model``), the LoRA adapter it serves (``adapter``), what the learning job
  trains on it (``learner``) and its one-process demo (``in_process``).

Registering imports nothing: the factory (and every callable of the registration) may import
its engine's modules when it is called, which is how the demo registers ``vllm`` without
importing vLLM, or even its own vLLM replica module, until a replica is built. A name is
registered at import of the module that defines its factory, because replica processes are
spawned and look the name up themselves: the demo's engines (``torch_lm``, ``torn_read``,
``vllm``) by :mod:`rollout_sync.demos.engines`, which :mod:`rollout_sync.demos.distributed`
imports. This package registers none itself.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..backend import RolloutBase
from ..lora import LoRAConfig
from ..payload import PayloadSender
from ..sync.mode import SyncMode
from ..trace import Timeline
from .torch_lm import TinyCausalLM as TinyCausalLM
from .torch_lm import TinyLMConfig as TinyLMConfig
from .torch_lm import TorchLMBackend as TorchLMBackend
from .torch_lm import TorchLMStatistics as TorchLMStatistics
from .torch_lm import TorchLMStreamBackend as TorchLMStreamBackend
from .torch_lm import tiny_lm_weights as tiny_lm_weights

if TYPE_CHECKING:  # rollout_sync.learn builds on this package: no import at run time
    from ..learn.models import LearnerModel

__all__ = [
    "LAUNCHERS",
    "AdapterModel",
    "EngineFactory",
    "EngineHandle",
    "EngineRequest",
    "InProcessRequest",
    "InProcessRun",
    "LearnerFactory",
    "RegisteredEngine",
    "TinyCausalLM",
    "TinyLMConfig",
    "TorchLMBackend",
    "TorchLMStatistics",
    "TorchLMStreamBackend",
    "TrainerModel",
    "engine_factory",
    "register_engine",
    "registered_engine",
    "registered_engines",
    "tiny_lm_weights",
    "unregister_engine",
]


LAUNCHERS = ("local", "ray", "torchrun")
"""What may place a job's replica processes (``rollout-sync demo --launcher``)."""


@dataclass(frozen=True)
class EngineRequest:
    """What an engine factory receives: the job's configuration and the replica's plumbing."""

    config: Any
    """The job's configuration, of whatever type the job that looks the engine up defines (the
    demo's: :class:`~rollout_sync.demos.job.DistributedDemoConfig`). The registry never reads
    it; the factory reads the fields it needs."""
    timeline: Timeline
    """The replica process's timeline: the engine records its forwards and writes in it."""
    sender: PayloadSender
    """The replica's payload sender: the engine ships every finished generation through it.
    It is the worker's ``data_packer`` too, so the guard holds it for every sync."""


def _nothing_to_release() -> None:
    """An :class:`EngineHandle`'s ``close`` when the engine holds nothing beyond itself."""


@dataclass
class EngineHandle:
    """What an engine factory returns: the engine, how to read its counters, how to release it."""

    rollout: RolloutBase
    """The engine, not started. A :class:`~rollout_sync.worker.BackgroundEngine` is started by
    the replica's worker inside the first sync's bracket and stopped when the worker closes."""
    counters: Callable[[], dict[str, int]]
    """Read once, after the run: ``forwards``, ``torn_forwards`` (what the engine's own detector
    saw; 0 without one), ``generation_pauses`` and ``installs``; extras are reported as given."""
    close: Callable[[], None] = _nothing_to_release
    """Release what the engine holds (an engine process); called last, after the replica's
    report is taken, also when the run failed."""


EngineFactory = Callable[[EngineRequest], EngineHandle]
"""Builds one replica's engine (not started) from an :class:`EngineRequest`."""

TrainerModel = Callable[[Any], tuple[dict[str, torch.Tensor], Callable[[int], None]]]
"""``trainer_model(config)``: the trainer's weights, named, shaped and typed like the engine's
served tensors (the same on every call for one config), and ``advance(step)``, which moves them
in place to the version of that step."""

AdapterModel = Callable[[Any], tuple[LoRAConfig, dict[str, tuple[int, int]]]]
"""``adapter(config)``: the LoRA adapter's manifest on this engine and the ``(in, out)`` of each
of its target modules (what :func:`~rollout_sync.lora.random_adapter` draws a set from)."""


LearnerFactory = Callable[[Any], "LearnerModel"]
"""``learner(config)``: what the learning job (``rollout-sync demo --learn``) trains on this
engine, a :class:`~rollout_sync.learn.models.LearnerModel`: how to build the trainer's float32
master with the weights the replicas start from, the dtype they serve, the vocabulary and
context, the default learning rate. Called before anything starts (it must not build the
model: its ``build`` does, in the trainer's process)."""


@dataclass(frozen=True)
class InProcessRequest:
    """What an engine's one-process demo receives (``rollout-sync demo --in-process``)."""

    syncs: int
    """Weight syncs to run (at least 1)."""
    guarded: bool
    """Run every sync inside the guard's bracket (``False``: ``--unguarded``)."""
    timeline: Timeline
    """Where the run records its spans (the command line writes it out with ``--trace``)."""
    stream: bool = False
    """``--stream``: generation streams on a scheduler thread. The command line passes it to
    the ``torch_lm`` engine only."""


InProcessRun = Callable[[InProcessRequest], dict[str, Any]]
"""Runs an engine's one-process demo and returns its report."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class RegisteredEngine:
    """An engine a job can run by name: its factory and what the job must know without building
    it. Built by :func:`register_engine`, which checks every field here (a bad combination is
    an error at registration, never when a replica starts)."""

    name: str
    factory: EngineFactory
    """Builds a replica's engine: see :data:`EngineFactory`."""
    trainer_model: TrainerModel | None = None
    """The trainer's weights in this engine's names (:data:`TrainerModel`); ``None``: the
    demo's trainer cannot drive this engine (the demo refuses it before anything starts)."""
    modes: frozenset[SyncMode] = frozenset({SyncMode.SYNC})
    """The sync modes the engine runs. The async modes need an engine that installs a weight
    buffer at its safe points (:class:`~rollout_sync.SupportsWeightBuffer`)."""
    start_s: float = 0.0
    """How long starting the engine may take (inside the first sync): a job adds it to its
    limits (the demo: to the run's limit and to every sync's ``timeout_s``)."""
    starts_processes: bool = False
    """The engine starts processes of its own: the replica processes must not be daemonic."""
    default_replicas: int = 3
    """The replicas a job runs when it is not told (``--replicas``)."""
    launchers: tuple[str, ...] | None = None
    """The launchers that may place the replica processes (``--launcher``: ``"local"``,
    ``"ray"``, ``"torchrun"``); ``None``: any."""
    adapter: AdapterModel | None = None
    """The LoRA adapter the engine serves (``--lora``); ``None``: it serves none."""
    learner: LearnerFactory | None = None
    """What the learning job trains on this engine (:data:`LearnerFactory`); ``None``: the
    learning job does not run on it (``--learn`` refuses it, naming the engines that have one).
    An engine with a learner builds its replicas for the learning job when the job's config
    asks (the demo's: ``config.learn``): fed the task's prompts, shipping rollouts."""
    requires: Callable[[], object] | None = None
    """Raises an :class:`ImportError` whose message says what to install when the engine
    cannot run here (vLLM's: :func:`~rollout_sync.backends.vllm.require_vllm`, whose error is
    a :class:`~rollout_sync.errors.RolloutSyncError` too); what it returns is ignored.
    ``None``: the engine needs nothing extra."""
    in_process: InProcessRun | None = None
    """The engine's one-process demo (``--in-process``); ``None``: it has none."""

    def __post_init__(self) -> None:
        where = f"register_engine({self.name!r}, ...)"
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"register_engine: an engine's name is letters, digits, '_', '.' and '-', "
                f"starting with a letter or digit (it is a --backend value), not {self.name!r}"
            )
        if not callable(self.factory):
            raise TypeError(f"{where}: the factory must be callable, not {self.factory!r}")
        if self.learner is not None and not callable(self.learner):
            raise TypeError(f"{where}: learner must be callable or None, not {self.learner!r}")
        if not self.modes or not all(isinstance(m, SyncMode) for m in self.modes):
            raise ValueError(f"{where}: modes must be one or more SyncMode, not {self.modes!r}")
        if not (math.isfinite(self.start_s) and self.start_s >= 0):
            raise ValueError(f"{where}: start_s must be finite and >= 0, not {self.start_s!r}")
        if self.default_replicas < 1:
            raise ValueError(
                f"{where}: default_replicas must be at least 1, not {self.default_replicas}"
            )
        if self.launchers is not None and not self.launchers:
            raise ValueError(f"{where}: launchers is None (any) or names at least one")
        unknown = [n for n in self.launchers or () if n not in LAUNCHERS]
        if unknown:
            raise ValueError(f"{where}: unknown launcher(s) {unknown}; choose from {LAUNCHERS}")

    def __repr__(self) -> str:
        parts = [
            ", ".join(sorted(m.value for m in self.modes)),
            f"{self.default_replicas} replicas",
            "any launcher" if self.launchers is None else " or ".join(self.launchers) + " only",
        ]
        if self.start_s:
            parts.append(f"starts within {self.start_s:g} s")
        extras = (
            ("starts processes", self.starts_processes),
            ("trainer model", self.trainer_model is not None),
            ("lora", self.adapter is not None),
            ("learner", self.learner is not None),
            ("requires", self.requires is not None),
            ("in-process", self.in_process is not None),
        )
        parts += [label for label, has in extras if has]
        return f"<RegisteredEngine {self.name!r}: {'; '.join(parts)}>"

    def runs_under(self, launcher: str) -> bool:
        """Whether ``launcher`` may place this engine's replica processes."""
        return self.launchers is None or launcher in self.launchers

    def check_available(self) -> None:
        """Raise what ``requires`` raises (an :class:`ImportError` saying what to install) when
        the engine cannot run here; return at once when it can, or needs nothing extra."""
        if self.requires is not None:
            self.requires()


_lock = threading.Lock()
_engines: dict[str, RegisteredEngine] = {}
"""Every registration by name; read and written under ``_lock``."""


def register_engine(
    name: str,
    factory: EngineFactory,
    *,
    trainer_model: TrainerModel | None = None,
    modes: Iterable[SyncMode] = (SyncMode.SYNC,),
    start_s: float = 0.0,
    starts_processes: bool = False,
    default_replicas: int = 3,
    launchers: Iterable[str] | None = None,
    adapter: AdapterModel | None = None,
    learner: LearnerFactory | None = None,
    requires: Callable[[], object] | None = None,
    in_process: InProcessRun | None = None,
    replace: bool = False,
) -> RegisteredEngine:
    """Make an engine available by ``name`` (``--backend name``) and return its registration.

    ``factory`` receives an :class:`EngineRequest` and returns an :class:`EngineHandle` (see
    the module docstring); it is not called here. Every keyword is a field of
    :class:`RegisteredEngine`, checked now. Register at import of the module that defines the
    factory, which every replica process imports.

    Raises:
        ValueError: ``name`` is registered already (pass ``replace=True`` to replace it), or a
            field is out of range (an empty ``modes``, a negative ``start_s``, ...).
        TypeError: ``factory`` is not callable.
    """
    engine = RegisteredEngine(
        name,
        factory,
        trainer_model=trainer_model,
        modes=frozenset(modes),
        start_s=float(start_s),
        starts_processes=starts_processes,
        default_replicas=default_replicas,
        launchers=None if launchers is None else tuple(launchers),
        adapter=adapter,
        learner=learner,
        requires=requires,
        in_process=in_process,
    )
    with _lock:
        if name in _engines and not replace:
            raise ValueError(
                f"an engine is registered as {name!r} already: pick another name, or pass "
                "replace=True to replace it"
            )
        _engines[name] = engine
    return engine


def unregister_engine(name: str) -> RegisteredEngine:
    """Take ``name`` out of the registry and return its registration.

    Raises:
        KeyError: no engine is registered as ``name`` (the message lists those that are).
    """
    with _lock:
        if name in _engines:
            return _engines.pop(name)
        known = sorted(_engines)
    raise KeyError(_unknown(name, known))


def registered_engine(name: str) -> RegisteredEngine:
    """The registration of ``name``.

    Raises:
        KeyError: no engine is registered as ``name``; the message lists those that are.
    """
    with _lock:
        engine = _engines.get(name)
        known = sorted(_engines)
    if engine is None:
        raise KeyError(_unknown(name, known))
    return engine


def engine_factory(name: str) -> EngineFactory:
    """The factory registered as ``name`` (``registered_engine(name).factory``).

    Raises:
        KeyError: no engine is registered as ``name``; the message lists those that are.
    """
    return registered_engine(name).factory


def registered_engines() -> tuple[str, ...]:
    """Every registered name, sorted."""
    with _lock:
        return tuple(sorted(_engines))


def _unknown(name: str, known: list[str]) -> str:
    return (
        f"no engine is registered as {name!r}; registered: {known}. Register it with "
        "rollout_sync.backends.register_engine(name, factory) at import of a module the job "
        "imports (the demo's engines are registered by rollout_sync.demos.engines)"
    )
