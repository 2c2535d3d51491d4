"""What a child of the process harness reports: typed values that survive pickling.

* :class:`ErrorReport` - an exception: its class lineage and its text, checked against the
  exception classes themselves (``report.is_a(WeightTransferError)``), never a name string.
* :class:`SyncOutcome` - what one rank's sync ended in: its error, how long it took, and for a
  replica the version it serves and whether it may serve it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backend import RolloutBase
from ..transfer import TransferStats
from ..worker import CommandResult

__all__ = ["ErrorReport", "SyncOutcome"]


@dataclass(frozen=True)
class ErrorReport:
    """An exception as a child reports it to the parent: its type's lineage and its text.

    Any exception can be reported so: one that would not unpickle in the parent (its
    ``__init__`` takes other arguments than its ``args``; the package's own do unpickle) is
    still told, and a test checks it against the exception classes themselves, subclasses
    included, never against a name string.
    """

    type_names: tuple[str, ...]
    """Qualified names of the exception's class and of every base it derives from."""
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> ErrorReport:
        return cls(tuple(_qualified(t) for t in type(exc).__mro__), str(exc))

    @classmethod
    def of_optional(cls, exc: BaseException | None) -> ErrorReport | None:
        return None if exc is None else cls.of(exc)

    @property
    def type_name(self) -> str:
        """The exception's own class, unqualified (``"WeightTransferError"``)."""
        return self.type_names[0].rpartition(".")[2]

    def is_a(self, *classes: type[BaseException]) -> bool:
        """Whether the exception was an instance of one of ``classes``."""
        return any(_qualified(c) in self.type_names for c in classes)

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class SyncOutcome:
    """What one rank's sync ended in, as a child reports it to the test.

    ``version`` and ``servable`` are both set (a replica's) or both ``None`` (a trainer's).
    """

    error: ErrorReport | None = None
    """What the sync raised; ``None``: it succeeded."""
    elapsed_s: float = 0.0
    """How long the sync took, as the child timed it."""
    version: int | None = None
    """The weight version the replica serves after the sync (``None``: not a replica)."""
    servable: bool | None = None
    """Whether the replica may serve its weights (not torn); ``None``: not a replica."""

    def __post_init__(self) -> None:
        if (self.version is None) != (self.servable is None):
            raise ValueError("SyncOutcome: version and servable are both set or both None")

    @classmethod
    def of(
        cls,
        result: BaseException | CommandResult | TransferStats | None,
        backend: RolloutBase | None = None,
        *,
        elapsed_s: float = 0.0,
    ) -> SyncOutcome:
        """From what the sync ended in: the exception it raised (a trainer's send), the
        :class:`~rollout_sync.worker.CommandResult` that ``RolloutWorker.handle`` returned, or a
        success (its ``TransferStats``, or ``None``); ``backend`` gives a replica's version and
        servability.

        Raises:
            ValueError: a failed ``CommandResult`` without its exception (one from the worker's
                history, which drops them: take the one ``handle`` returns).
            TypeError: ``result`` is none of these.
        """
        error: ErrorReport | None = None
        if isinstance(result, BaseException):
            error = ErrorReport.of(result)
        elif isinstance(result, CommandResult):
            if not result.ok:
                if result.exception is None:
                    raise ValueError(
                        "SyncOutcome.of needs the CommandResult that handle() returns: this "
                        f"failed one has no exception (the worker's history drops them): "
                        f"{result.error}"
                    )
                error = ErrorReport.of(result.exception)
        elif result is not None and not isinstance(result, TransferStats):
            raise TypeError(
                "SyncOutcome.of takes an exception, a CommandResult, TransferStats or None, "
                f"not {type(result).__name__}"
            )
        if backend is None:
            return cls(error, elapsed_s)
        return cls(error, elapsed_s, backend.weight_version, not backend.weights_torn)

    @property
    def ok(self) -> bool:
        return self.error is None

    def failed_with(self, *classes: type[BaseException]) -> bool:
        """Whether the sync raised an instance of one of ``classes``."""
        return self.error is not None and self.error.is_a(*classes)
