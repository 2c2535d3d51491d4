"""What a child of the process harness reports: typed values that survive pickling.

* :class:`ErrorReport` - an exception: its class lineage and its text, checked against the
  exception classes themselves (``report.is_a(WeightTransferError)``), never a name string.
* :class:`SyncOutcome` - what one rank's sync ended in: its error, how long it took, and for a
  replica the version it serves and whether it may serve it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ErrorReport", "SyncOutcome"]


@dataclass(frozen=True)
class ErrorReport:
    """An exception as a child reports it to the parent: its type's lineage and its text.

    Exceptions do not all survive pickling (their ``__init__`` may take other arguments than
    ``args``) and carry their traceback's frames; this does, and a test checks it against the
    exception classes themselves, subclasses included, never against a name string.
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
    """What one rank's sync ended in, as a child reports it to the test."""

    error: ErrorReport | None = None
    elapsed_s: float = 0.0
    version: int | None = None
    """The weight version the replica serves after the sync (``None``: not a replica)."""
    servable: bool | None = None
    """Whether the replica may serve its weights (not torn); ``None``: not a replica."""

    @classmethod
    def of(cls, result: Any, backend: Any = None, *, elapsed_s: float = 0.0) -> SyncOutcome:
        """From what the sync returned: an exception (the trainer's), a worker's
        ``CommandResult`` (its ``exception``), or anything else (it succeeded); ``backend``
        (a :class:`~rollout_sync.RolloutBase`) gives the version and servability."""
        if isinstance(result, BaseException):
            error: ErrorReport | None = ErrorReport.of(result)
        else:
            error = ErrorReport.of_optional(getattr(result, "exception", None))
        if backend is None:
            return cls(error, elapsed_s)
        return cls(error, elapsed_s, backend.weight_version, not backend.weights_torn)

    @property
    def ok(self) -> bool:
        return self.error is None

    def failed_with(self, *classes: type[BaseException]) -> bool:
        """Whether the sync raised an instance of one of ``classes``."""
        return self.error is not None and self.error.is_a(*classes)
