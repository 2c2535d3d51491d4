"""Every exception rollout_sync raises on purpose, in one place so callers catch them by family.

Every one derives from :class:`RolloutSyncError`. Every timeout derives from
:class:`RolloutSyncTimeout`, which is both a :class:`RolloutSyncError` and the builtin
:class:`TimeoutError` (the library never raises a bare ``TimeoutError``), and names the
operation, the limit and what was still in the way, so a log line alone tells what hung.

The families, in the order a weight sync meets them:

* the guard: :class:`WorkerContractError` (a worker the guard cannot guard),
  :class:`GateTimeout` and its kinds (:class:`PauseTimeout`, :class:`EgressHoldTimeout`,
  :class:`IngressHoldTimeout`), :class:`FenceTimeout`, :class:`PausedContractViolation` (a
  backend's ``paused()`` failed the contract suite);
* the weights: :class:`WeightMismatchError` (validation before any write; ``WriteRefused``,
  a vLLM engine's refusal of an in-place write, is the same class),
  :class:`TornWeightsError` (generation refused), :class:`WeightTransferError` and its kinds
  (:class:`P2RBarrierMismatch`: only one side of a P2R takes the barrier),
  :class:`ManifestError`, :class:`WeightsNotLandedError` (vLLM);
* processes and collectives: :class:`CollectiveError`, :class:`CollectiveTimeout`,
  :class:`GroupProcessError` (with its :class:`ChildFailure` records, defined beside it in
  ``_failures``: a record, not an exception);
* the payload transport: :class:`PayloadTransportError`, :class:`PayloadTimeout` and kinds;
* the trainer side: :class:`WeightBroadcastError`, :class:`MetricKeyCollisionError`,
  :class:`HarvestTimeout`;
* engines and threads: :class:`GenerationTimeout` (``SchedulerTimeout`` is the same class),
  :class:`EngineCallTimeout`, :class:`CommandTimeout`, :class:`RunInterrupted`,
  :class:`InstallTimeout`, :class:`ShutdownTimeout`, :class:`WeightSyncThreadError`;
* deltas: :class:`DeltaError` (a delta refused before any write), :class:`DeltaRefused` (a
  receive that refused one: nothing written);
* the learning loop (``rollout_sync.learn``, ``rollout-sync demo --learn``):
  :class:`InvalidRollout`, :class:`LearningStarved`;
* an optional dependency that is missing (vLLM, Ray, Redis, matplotlib, cosmos-rl):
  :class:`MissingDependencyError`, under every old name (``VLLMUnavailableError``,
  ``RayUnavailableError``, ``RedisUnavailableError``, ``MatplotlibUnavailableError``,
  ``CosmosRLVersionError``).

Some old names are aliases of the class that took their place (``X = Y``): each raised exactly
what it names, and no caller catches the merged classes apart. ``except`` with the old name
catches what it caught before; it now also catches what it was merged with (``except
SchedulerTimeout`` a vLLM generation's timeout, ``except VLLMUnavailableError`` any missing
dependency), and the class name in a traceback is the surviving one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ._failures import ChildFailure as ChildFailure

__all__ = [
    "ChecksumMismatchError",
    "ChildFailure",
    "CollectiveError",
    "CollectiveTimeout",
    "CommandTimeout",
    "CosmosRLVersionError",
    "DeltaError",
    "DeltaRefused",
    "EgressHoldTimeout",
    "EngineCallTimeout",
    "EngineOutOfStepError",
    "FastLLMEventTimeout",
    "FastLLMProtocolError",
    "FenceTimeout",
    "GateTimeout",
    "GenerationTimeout",
    "GroupProcessError",
    "HarvestTimeout",
    "IngressHoldTimeout",
    "InstallTimeout",
    "InvalidRollout",
    "LearningStarved",
    "ManifestError",
    "ManifestRejected",
    "MatplotlibUnavailableError",
    "MetricKeyCollisionError",
    "MissingDependencyError",
    "P2RBarrierMismatch",
    "PauseTimeout",
    "PausedContractViolation",
    "PayloadBackpressureTimeout",
    "PayloadPeerTimeout",
    "PayloadSendersFailed",
    "PayloadTimeout",
    "PayloadTransportError",
    "PayloadsExhausted",
    "RayUnavailableError",
    "RecoveryError",
    "RecoveryTimeout",
    "RedisUnavailableError",
    "RelayForwardError",
    "RolloutSyncError",
    "RolloutSyncTimeout",
    "RunInterrupted",
    "SchedulerTimeout",
    "ShutdownTimeout",
    "StagedCommitAborted",
    "TornWeightsError",
    "TransferPlanMismatch",
    "TwoCommunicatorsRefused",
    "UnsafeHeaderError",
    "VLLMUnavailableError",
    "WeightBroadcastError",
    "WeightBroadcastTimeout",
    "WeightMismatchError",
    "WeightSyncThreadError",
    "WeightTransferError",
    "WeightTransferTimeout",
    "WeightsNotLandedError",
    "WorkerContractError",
    "WouldBlock",
    "WriteRefused",
]


class RolloutSyncError(Exception):
    """Base class of every error rollout_sync raises on purpose.

    Every one survives pickling with its attributes (a Ray task, a spawned child, a queue
    between processes), whatever its ``__init__`` takes: it is rebuilt from its ``args`` and
    attributes, not by calling ``__init__`` again.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), self.args, self.__dict__))


def _rebuild_error(
    cls: type[RolloutSyncError], args: tuple[Any, ...], state: dict[str, Any]
) -> RolloutSyncError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class WouldBlock(RolloutSyncError):
    """A ``*_nowait`` call could not proceed without waiting."""


class RolloutSyncTimeout(RolloutSyncError, TimeoutError):
    """Base class of every timeout rollout_sync raises: a wait that ran past its limit.

    Catch it to handle any of the package's timeouts at once (a hung peer, a pause that did not
    park, a command that never came); the subclasses say which wait it was and carry what they
    know (the operation, the limit, the version). Also a builtin :class:`TimeoutError`.
    """


# -- the guard ---------------------------------------------------------------------------------


class WorkerContractError(RolloutSyncError, TypeError):
    """A decorated worker does not meet the guard's contract (:class:`~rollout_sync.guard.
    WeightSyncWorker`): an attribute the guard reads is missing or of the wrong kind.

    Raised at the first sync, before anything is paused, held or written.

    Attributes:
        attribute: the attribute the guard looked for.
    """

    def __init__(self, message: str, *, attribute: str) -> None:
        super().__init__(message)
        self.attribute = attribute


class GateTimeout(RolloutSyncTimeout):
    """A :class:`~rollout_sync.Gate` wait ran past its limit.

    Attributes:
        operation: what was being waited for, in words.
        timeout: the limit, in seconds.
        sections_running: sections still inside the gate when the wait gave up.
    """

    def __init__(self, message: str, *, operation: str, timeout: float, sections_running: int):
        super().__init__(message)
        self.operation = operation
        self.timeout = timeout
        self.sections_running = sections_running


class PauseTimeout(GateTimeout):
    """Generation did not park within the limit (a forward kept running)."""


class PausedContractViolation(RolloutSyncError, AssertionError):
    """A backend's ``paused()`` broke its contract in a check of the contract suite
    (:mod:`rollout_sync.testing.paused_contract`).

    An ``AssertionError`` too, so a test runner reports it as a failed assertion. The message
    names the backend, the check and what was seen (a forward while parked, a pause that did not
    honour its timeout, an exception swallowed, ...).

    Attributes:
        backend: the ``name`` of the :class:`~rollout_sync.testing.paused_contract.PausedContract`.
        check: the check that failed (``"check_reentrant"``, ...).
    """

    def __init__(self, message: str, *, backend: str, check: str) -> None:
        super().__init__(message)
        self.backend = backend
        self.check = check


class EgressHoldTimeout(GateTimeout):
    """Payload egress could not be held or flushed within the limit (a send kept running)."""


class IngressHoldTimeout(GateTimeout):
    """Payload receives could not be held or flushed within the limit (a receive kept running)."""


class FenceTimeout(RolloutSyncTimeout):
    """Device work did not complete within the limit (the fence after a weight sync, or the
    reverse fence of an async-mode weight buffer)."""


# -- weights -----------------------------------------------------------------------------------


class WeightMismatchError(RolloutSyncError, ValueError):
    """Incoming weights do not fit the served ones; nothing was written.

    Attributes:
        problems: one line per mismatch (unknown name, missing name, shape, dtype).
    """

    ADVICE = (
        "Check that trainer and rollout build the same model architecture and that the "
        "trainer sends served (not training-only, e.g. optimizer or LoRA) parameter names."
    )
    """What the message advises unless the raiser knows better (``advice``)."""

    def __init__(
        self, problems: list[str], *, context: str = "incoming weights", advice: str | None = None
    ) -> None:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(
            f"{context} do not match the served weights ({len(problems)} problem(s)); "
            f"no served tensor was written:\n  {shown}{more}\n"
            + (advice if advice is not None else self.ADVICE)
        )
        self.problems = problems


class TornWeightsError(RolloutSyncError):
    """The served weights are known to be a mix of two versions; generation is refused.

    Raised after a synchronous weight transfer failed part-way. The only way out is a complete,
    successful sync.
    """


class ManifestError(RolloutSyncError, ValueError):
    """A weight manifest could not be built or decoded."""


class WeightTransferError(RolloutSyncError):
    """A weight transfer failed.

    Attributes:
        operation: what was being done ("receive bucket 3/12 of version 7 from rank 0").
        version: the weight version being transferred, if the manifest got that far.
        tensors_written: target tensors this rank had (partly) written when it failed. Zero
            means the targets are exactly as before.
        complete: this rank received and wrote every tensor intact; the transfer failed
            elsewhere in the group (another rank's checksum). Its targets hold ``version``
            whole.
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        version: int | None = None,
        tensors_written: int = 0,
        complete: bool = False,
    ) -> None:
        super().__init__(message)
        self.operation = operation
        self.version = version
        self.tensors_written = tensors_written
        self.complete = complete

    @property
    def targets_torn(self) -> bool:
        """Whether this rank's targets now mix two versions (written, but not completely)."""
        return self.tensors_written > 0 and not self.complete


class WeightTransferTimeout(WeightTransferError, RolloutSyncTimeout):
    """A collective of the transfer did not complete within the limit."""


class ManifestRejected(WeightTransferError):
    """Another rank rejected the manifest (or the source aborted); nothing was written.

    Attributes:
        rejected_by: global ranks that said no.
    """

    def __init__(
        self, message: str, *, operation: str, version: int | None, rejected_by: Sequence[int]
    ) -> None:
        super().__init__(message, operation=operation, version=version)
        self.rejected_by = tuple(rejected_by)


class P2RBarrierMismatch(ManifestRejected):
    """Only one side of a P2R takes the P2R barrier; no weights were sent or written.

    The trainer's ``TransferWeightPusher(barrier=...)`` and the replica's
    ``RolloutWorker(p2r_barrier=...)`` must agree: both or neither. The barrier's first
    collective has the shape of a manifest header, so when they disagree each side finds out
    within its first three collectives of the sync (on gloo, where barrier and transfer share
    the group) and raises this, rather than waiting out the timeout. Nothing is written on
    either side and both took part in the same collectives, so the group stays usable: the next
    P2R, configured alike on both sides, goes through.

    Attributes:
        missing_on: ``"trainer"`` or ``"replica"``: the side that takes no barrier.
        rejected_by: the global rank of that side (unlike other :class:`ManifestRejected`, not
            necessarily a rank that voted no).
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        version: int | None,
        missing_on: Literal["trainer", "replica"],
        rank: int,
    ) -> None:
        super().__init__(message, operation=operation, version=version, rejected_by=(rank,))
        self.missing_on = missing_on


class TransferPlanMismatch(ManifestRejected):
    """The ranks of a sharded transfer computed different transfer plans (their layouts, bucket
    size or checksum setting differ); refused on every rank before any byte moved.

    Attributes:
        digests: each global rank's plan digest.
        rejected_by: the ranks whose digest differs from the first source rank's.
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        version: int | None,
        digests: Mapping[int, int],
        rejected_by: Sequence[int],
    ) -> None:
        super().__init__(message, operation=operation, version=version, rejected_by=rejected_by)
        self.digests = dict(digests)


class RelayForwardError(WeightTransferError):
    """A pipelined relay received its version whole, but passing it on failed.

    Raised by :meth:`~rollout_sync.WeightTransfer.relay` after the relay's own receive
    completed (``complete`` is true: the relay's targets hold ``version`` whole; a worker
    commits it and still reports the failure). The downstream receivers got nothing (a
    rejected manifest) or fail on their own side (a dead relay, a bad bucket).

    Attributes:
        cause: the forwarding's own error (:class:`ManifestRejected`,
            :class:`ChecksumMismatchError`, a timeout or a dead receiver).
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        version: int,
        tensors_written: int,
        cause: WeightTransferError,
    ) -> None:
        super().__init__(
            message,
            operation=operation,
            version=version,
            tensors_written=tensors_written,
            complete=True,
        )
        self.cause = cause


class ChecksumMismatchError(WeightTransferError):
    """A bucket's bytes differ from what its source (or the original sender) checksummed.

    Attributes:
        buckets: indices of the buckets that failed, on this rank.
        failed_ranks: global ranks that reported a failure in the commit vote.
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        version: int | None,
        tensors_written: int,
        buckets: Sequence[int],
        failed_ranks: Sequence[int],
        complete: bool = False,
    ) -> None:
        super().__init__(
            message,
            operation=operation,
            version=version,
            tensors_written=tensors_written,
            complete=complete,
        )
        self.buckets = tuple(buckets)
        self.failed_ranks = tuple(failed_ranks)


class StagedCommitAborted(WeightTransferError):
    """A staged version was installed on no replica of its sync (the two-phase commit).

    Every replica of the sync staged and verified the version, then voted (the transfer's
    commit vote); at least one said no, or the transfer failed before the vote, so none
    installs it and every replica keeps serving ``kept_version``. The served weights were not
    touched (``tensors_written`` is 0): nothing is torn and nothing needs re-seeding. (After
    a yes vote, an install that fails on one replica is raised as what failed, not as this:
    that replica is behind the others until the next sync; docs/staged.md.)

    Attributes:
        failed_ranks: global ranks that voted no (empty when the transfer failed before the
            vote: then ``__cause__`` says why).
        kept_version: the version this replica goes on serving.
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        version: int | None,
        failed_ranks: Sequence[int],
        kept_version: int,
    ) -> None:
        super().__init__(message, operation=operation, version=version, tensors_written=0)
        self.failed_ranks = tuple(failed_ranks)
        self.kept_version = kept_version


class TwoCommunicatorsRefused(RolloutSyncError, ValueError):
    """A configuration would put two NCCL communicators in flight on one device at once.

    A staged (or async-mode) receive runs while the engine's forwards run. When those
    forwards do their own collectives over NCCL (tensor parallelism) and the weight transfer
    is NCCL too, the two would overlap on the device: the hazard this package exists to
    prevent. Choose ``SyncMode.SYNC`` (the receive runs parked, as before) or a transfer over a
    gloo group (staging through host memory). Raised at construction, before anything runs.
    """


class WeightsNotLandedError(RolloutSyncError):
    """A vLLM weight write was refused, or did not change what the engine computes with.

    Attributes:
        problems: one line per tensor that was refused or did not land.
        torn: whether anything may have been written. When true the backend has marked its
            weights torn and keeps generation parked until a complete sync lands.
    """

    def __init__(self, problems: list[str], *, torn: bool, context: str) -> None:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        state = (
            "the served weights are now torn; generation stays parked until a complete sync lands"
            if torn
            else "nothing was written"
        )
        super().__init__(f"{context}: {len(problems)} problem(s), {state}:\n  {shown}{more}")
        self.problems = problems
        self.torn = torn


WriteRefused = WeightMismatchError
"""Inside a vLLM engine, a write refused before any served tensor was touched (a parameter
repacked by the platform): what :class:`WeightMismatchError` says, nothing written, the
reasons in ``problems``."""


# -- processes and collectives -----------------------------------------------------------------


class CollectiveError(RolloutSyncError):
    """A collective failed: a peer died, closed its connection, or the group is broken.

    Attributes:
        operation: what was being done, in words ("broadcast bucket 3/12 from rank 0").
        group: the global ranks of the group.
    """

    def __init__(self, message: str, *, operation: str, group: Sequence[int]) -> None:
        super().__init__(message)
        self.operation = operation
        self.group = tuple(group)


class CollectiveTimeout(CollectiveError, RolloutSyncTimeout):
    """A collective did not complete within its limit (a peer hung or never joined).

    Attributes:
        timeout: the limit, in seconds.
    """

    def __init__(
        self, message: str, *, operation: str, group: Sequence[int], timeout: float
    ) -> None:
        super().__init__(message, operation=operation, group=group)
        self.timeout = timeout


class GroupProcessError(RolloutSyncError, ChildProcessError):
    """One or more processes of a group failed, died or overstayed: children of
    :func:`~rollout_sync.testing.run_processes`, or ranks of a launcher's job
    (:class:`~rollout_sync.launch.ray.RayJob`).

    Attributes:
        failures: one :class:`ChildFailure` per failed process, the first to fail first. A
            local child killed by a signal has the negative signal number as its exit code
            (``-9`` for SIGKILL), as :mod:`multiprocessing` reports it.
        results: the return values of the processes that did finish, by rank.
    """

    def __init__(self, failures: list[ChildFailure], results: dict[int, Any], what: str) -> None:
        parts = [
            f"--- rank {f.rank} (exit code {f.exitcode}) ---\n{f.error.rstrip()}" for f in failures
        ]
        super().__init__(f"{what}: {len(failures)} child process(es) failed\n" + "\n".join(parts))
        self.failures = failures
        self.results = results


# -- the payload transport ---------------------------------------------------------------------


class PayloadTransportError(RolloutSyncError):
    """The payload transport broke (a peer went away, the protocol was violated) or is closed.

    Attributes:
        peer: the global rank of the peer whose connection failed, when one did.
        cause: ``"closed"`` (its connection closed: the peer most likely died) or
            ``"timeout"`` (it took nothing within the limit: hung, or not serving its
            transport); ``None`` for other failures.
    """

    def __init__(self, message: str, *, peer: int | None = None, cause: str | None = None):
        super().__init__(message)
        self.peer = peer
        self.cause = cause


class PayloadPeerTimeout(PayloadTransportError, RolloutSyncTimeout):
    """A payload peer took nothing within the limit (``cause="timeout"``): it hung, or is not
    serving its transport. On gloo the transport is unusable afterwards."""


class PayloadsExhausted(PayloadTransportError):
    """Every payload sender has closed and every payload it sent was taken: the stream ended."""


class PayloadSendersFailed(PayloadsExhausted):
    """The stream ended, but not cleanly: at least one sender failed (its process died, say)
    instead of closing, so whatever it had not sent, and what it had in flight, never came.
    :meth:`~rollout_sync.PayloadReceiver.iter_payloads` raises it where a clean end returns.

    Attributes:
        failed_senders: rank -> how that sender failed (``"closed"``, ``"timeout"``, ...).
        lost: payloads that were in flight from failed senders (the receiver's ``lost``).
    """

    def __init__(self, message: str, *, failed_senders: dict[int, str], lost: int) -> None:
        super().__init__(message)
        self.failed_senders = failed_senders
        self.lost = lost


class PayloadTimeout(RolloutSyncTimeout):
    """A payload wait ran past its limit (a receive, a drain, a close).

    Attributes:
        operation: what was being waited for, in words.
        timeout: the limit, in seconds.
    """

    def __init__(self, message: str, *, operation: str, timeout: float) -> None:
        super().__init__(message)
        self.operation = operation
        self.timeout = timeout


class PayloadBackpressureTimeout(PayloadTimeout):
    """A payload could not be registered: the sender's registry stayed full past the limit.

    Nothing was evicted to make room; the payload was not registered and may be retried.
    """


# -- the trainer side --------------------------------------------------------------------------


class WeightBroadcastError(RolloutSyncError):
    """A trainer-side weight broadcast or its command announcement failed.

    Raised with the operation, the limit and the process group in the message; the cause (the
    backend's own error) is chained. A timeout is the subclass
    :class:`WeightBroadcastTimeout`.
    """


class WeightBroadcastTimeout(WeightBroadcastError, RolloutSyncTimeout):
    """A trainer-side weight broadcast, or a command announcement or receipt, did not complete
    within its limit (a full command queue, a peer that never joined the broadcast)."""


class MetricKeyCollisionError(RolloutSyncError, ValueError):
    """Two sources of a step's metrics use the same key; nothing was merged.

    Attributes:
        key: the metric name both used.
        first: the source that had it first (``"train_metrics"`` or a callback's name).
        second: the source that tried to add it again.
    """

    def __init__(self, message: str, *, key: str, first: str, second: str) -> None:
        super().__init__(message)
        self.key = key
        self.first = first
        self.second = second


class HarvestTimeout(RolloutSyncTimeout):
    """An explicit wait for a timer's pending samples ran past its limit.

    Only :meth:`~rollout_sync.WeightSyncTimer.drain` waits; harvesting never does.

    Attributes:
        timeout: the limit, in seconds.
        pending: samples whose end event was still incomplete when the wait gave up.
    """

    def __init__(self, message: str, *, timeout: float, pending: int) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.pending = pending


# -- optional dependencies ------------------------------------------------------------------


class MissingDependencyError(RolloutSyncError, ImportError):
    """An optional dependency is missing: not installed, failing to import, or not the version
    the module that needs it was written against. Raised before anything started.

    The message names what needs it and how to install it: ``pip install 'rollout-sync[extra]'``
    where an extra of this package installs it (added to the message when the raiser's words
    do not say it already), otherwise what to install (a system package, a pinned version).
    An :class:`ImportError` too. Every old name of a missing dependency is this class:
    ``VLLMUnavailableError``, ``RayUnavailableError``, ``RedisUnavailableError``,
    ``MatplotlibUnavailableError``, ``CosmosRLVersionError``; tell them apart by ``package``.

    Attributes:
        package: what is missing, as one installs it (``"vllm"``, ``"ray"``, ``"redis"``,
            ``"matplotlib"``, ``"cosmos-rl"``; ``"redis-server"``, the system's executable).
        extra: the extra of ``rollout-sync`` that installs it (``"vllm"``, ``"ray"``,
            ``"fast-llm"``, ``"plot"``), or ``None`` where none does.
    """

    def __init__(self, message: str, *, package: str, extra: str | None = None) -> None:
        if extra is not None and f"pip install 'rollout-sync[{extra}]'" not in message:
            message = f"{message}; pip install 'rollout-sync[{extra}]'"
        super().__init__(message)
        self.package = package
        self.extra = extra


VLLMUnavailableError = MissingDependencyError
"""vLLM is not installed (or fails to import); ``package="vllm"``, ``extra="vllm"``."""

RayUnavailableError = MissingDependencyError
"""Ray is not installed (or fails to import); ``package="ray"``, ``extra="ray"``."""

RedisUnavailableError = MissingDependencyError
"""No ``redis-server`` executable (``package="redis-server"``: a system package), or no
``redis`` Python client (``package="redis"``, ``extra="fast-llm"``): the Fast-LLM receiver's
tests and demo start the system's redis-server."""

MatplotlibUnavailableError = MissingDependencyError
"""matplotlib, which draws the picture of a timeline (:mod:`rollout_sync.trace_plot`), is not
installed (or fails to import); ``package="matplotlib"``, ``extra="plot"``."""

CosmosRLVersionError = MissingDependencyError
"""cosmos-rl is not installed, or not the version :mod:`rollout_sync.integrations.cosmos_rl` was
written against (it patches cosmos's internals, so it refuses any other): ``package="cosmos-rl"``,
no extra (the message names the version to install)."""


# -- engines, workers and their threads --------------------------------------------------------


class GenerationTimeout(RolloutSyncTimeout):
    """A wait on a generation engine ran past its limit: a request's tokens or result, a
    ``generate()`` call, the engine's scheduler becoming idle or its thread stopping.

    One class for every engine (the scheduler of :class:`~rollout_sync.RolloutTaskScheduler`,
    the vLLM backends), so code that generates catches one name whichever engine serves it.
    """


SchedulerTimeout = GenerationTimeout
"""A :class:`~rollout_sync.RolloutTaskScheduler` wait (for a result, for idleness, for the
thread to stop) ran past its limit: a :class:`GenerationTimeout`."""


class EngineCallTimeout(RolloutSyncTimeout):
    """A call into the vLLM engine did not return within its limit."""


class RecoveryError(RolloutSyncError):
    """Recovering from a dead process could not proceed (a call without what its role needs,
    a failed teardown); see :mod:`rollout_sync.recovery`."""


class RecoveryTimeout(RecoveryError, RolloutSyncTimeout):
    """Leaving the broken job, or meeting at the new rendezvous, did not finish in time."""


class CommandTimeout(RolloutSyncTimeout):
    """A rollout worker waited longer than its limit for the next command (is the controller
    alive?)."""


class RunInterrupted(RolloutSyncError):
    """:meth:`~rollout_sync.RolloutWorker.run` left its loop because
    :meth:`~rollout_sync.RolloutWorker.interrupt` was called (a controller saw the job break and
    the replica must recover); the command being handled, if any, finished first.

    Attributes:
        reason: what the interrupting caller said.
    """

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class InstallTimeout(RolloutSyncTimeout):
    """An async-mode weight version was not installed at a safe point within the limit (is the
    backend generating?)."""


class ShutdownTimeout(RolloutSyncTimeout):
    """A thread, engine or sender did not stop within its limit."""


class DeltaError(RolloutSyncError, ValueError):
    """A delta that cannot apply to its target (:mod:`rollout_sync.transfer.delta`): a size or
    dtype that differs, a block out of range or order, a byte count that does not match, a
    position out of range, unsorted or repeated. Raised before anything is written; the
    message names the tensor and the block. Also a :class:`ValueError`."""


class DeltaRefused(WeightTransferError):
    """This receiver refused a delta that arrived (a packed delta malformed or truncated,
    positions out of range, unsorted or repeated, or the result would not equal the sender's
    new version by its digest): nothing was written, or what was written was restored bit for
    bit, so ``tensors_written`` is 0 and the replica serves the version it held. It voted no:
    the source's send raises :class:`ChecksumMismatchError` naming it. The cause, a
    :class:`DeltaError`, is chained and named in the message."""


class InvalidRollout(RolloutSyncError, ValueError):
    """A payload that is not a consistent rollout of the learning loop (a part missing, lengths
    that disagree, a log-probability that is not finite or above 0); the message says which.
    Also a :class:`ValueError`."""


class LearningStarved(RolloutSyncTimeout):
    """A training step of the learning loop waited its limit for enough whole groups of
    rollouts fresh enough to train on."""


class WeightSyncThreadError(RolloutSyncError):
    """The weight-sync thread failed, or did not stop within its limit."""


class EngineOutOfStepError(RolloutSyncError, RuntimeError):
    """A vLLM engine with several workers answered a call with a stale answer: after one
    worker failed an all-worker call, vLLM's multiprocess executor reads the others' answers one
    call late (vLLM issue #49972). It can no longer be updated or checked: restart the engine.
    Also a :class:`RuntimeError`."""


class FastLLMProtocolError(RolloutSyncError):
    """Fast-LLM's weight stream or event stream broke the protocol (or could not be read): the
    stream is abandoned and nothing of it is written."""


class FastLLMEventTimeout(FastLLMProtocolError, RolloutSyncTimeout):
    """No Fast-LLM event (or not the one waited for) arrived within the limit."""


class UnsafeHeaderError(FastLLMProtocolError):
    """A Fast-LLM tensor header held something other than the protocol's types (str, tuple,
    ``torch.Size``, ``torch.dtype``, None) or was longer than the receiver accepts: it was not
    unpickled further."""
