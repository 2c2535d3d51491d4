"""The payload transport's wire and what both ends share: frames, buffers, bounded waits.

Two process groups carry a transport (see :class:`~rollout_sync.payload.PayloadGroups`):

* the **control** group (always gloo, CPU) carries fixed-size int64 *frames*: credit requests,
  offers and their answers, resume notices, goodbyes. Nothing on it touches the device, so it
  may be used while a weight collective runs.
* the **data** group (NCCL on GPU, gloo on CPU) carries only payload buffers, and only after
  both ends agreed on the transfer over the control group.

A payload buffer is one flat ``uint8`` tensor: an 8-byte little-endian manifest length, the
manifest (JSON: tensor names, dtypes, shapes, offsets, plus the caller's metadata), padding to
16 bytes, then each tensor's bytes at a 16-byte aligned offset (so the receiver can view them
in place as their dtype).

:class:`TransportEnd` is the machinery the sender and the receiver share: one lock, a failure
that sticks, waits bounded by a deadline, and the hold over the end's payload transfers.

Private: the public names are in :mod:`rollout_sync.payload.sender` and
:mod:`rollout_sync.payload.receiver`.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .._deadline import (
    collective_failure,
    deadline_after,
    expired,
    limit_of,
    wait_arg,
    wait_collective,
    wait_device_idle,
)
from ..errors import (
    CollectiveError,
    CollectiveTimeout,
    GateTimeout,
    PayloadPeerTimeout,
    PayloadTransportError,
)
from ..gate import Gate

FRAME_WORDS = 64
"""Every control frame is this many int64 words (512 bytes)."""
_HEADER_WORDS = 8
MAX_BATCH = FRAME_WORDS - _HEADER_WORDS
"""The most payloads one offer (one transfer) can carry: one size word each."""
PROTOCOL_VERSION = 2
"""2: REQUEST and BYE_ACK carry the count of acknowledged payloads."""
_VERSION_WORD = 7
_ALIGN = 16


class FrameKind(enum.IntEnum):
    """What a control frame says. Words 1.. depend on the kind (see each member)."""

    REQUEST = 1
    """receiver -> sender: [request_id, credits, timeout_us, acknowledged]. Credit for
    ``credits`` payloads; ``acknowledged``: how many of this sender's payloads (in order) the
    trainer has taken and moved on from."""
    EXPIRED = 2
    """sender -> receiver: [request_id, credits_left]. The request ran out unserved."""
    OFFER = 3
    """sender -> receiver: [offer_id, first_seq, count, first_request_id, coalesced], sizes
    from word 8. ``coalesced``: 1 if the payloads travel as one concatenated message."""
    ACCEPT = 4
    """receiver -> sender: [offer_id]. Receives are posted; send now."""
    DEFER = 5
    """receiver -> sender: [offer_id]. Receives are held; offer again after RESUME."""
    RESUME = 6
    """receiver -> sender: []. The receive hold that deferred an offer has ended."""
    BYE = 7
    """sender -> receiver: [total_registered]. The sender is closing; nothing more will come."""
    BYE_ACK = 8
    """receiver -> sender: [acknowledged]. The last frame on this pair."""


def make_frame(kind: FrameKind, *words: int, sizes: Sequence[int] = ()) -> torch.Tensor:
    """A control frame of ``kind`` with ``words`` from word 1 and ``sizes`` from word 8."""
    if len(words) > _HEADER_WORDS - 2 or len(sizes) > MAX_BATCH:
        raise ValueError(f"frame too long: {len(words)} words, {len(sizes)} sizes")
    frame = torch.zeros(FRAME_WORDS, dtype=torch.int64)
    frame[0] = int(kind)
    if words:
        frame[1 : 1 + len(words)] = torch.tensor(words, dtype=torch.int64)
    frame[_VERSION_WORD] = PROTOCOL_VERSION
    if sizes:
        frame[_HEADER_WORDS : _HEADER_WORDS + len(sizes)] = torch.tensor(sizes, dtype=torch.int64)
    return frame


def read_frame(frame: torch.Tensor, peer: int) -> tuple[FrameKind, list[int]]:
    """Decode a received frame into its kind and all its words (word 0 is the kind).

    Raises:
        PayloadTransportError: the frame is not one this version of the protocol sends.
    """
    words: list[int] = frame.tolist()
    if words[_VERSION_WORD] != PROTOCOL_VERSION:
        raise PayloadTransportError(
            f"rank {peer} sent a control frame of protocol version {words[_VERSION_WORD]}, "
            f"this process speaks version {PROTOCOL_VERSION}: are both ends running the same "
            "rollout_sync, and is the control group used by anything else?"
        )
    try:
        return FrameKind(words[0]), words
    except ValueError:
        raise PayloadTransportError(
            f"rank {peer} sent an unknown control frame kind {words[0]}"
        ) from None


def offer_sizes(words: list[int], count: int) -> list[int]:
    return words[_HEADER_WORDS : _HEADER_WORDS + count]


def send_frame(frame: torch.Tensor, peer: int, group: dist.ProcessGroup, timeout: float) -> None:
    """Send a control frame to ``peer`` on the control ``group``, waiting at most ``timeout`` s.

    Raises:
        PayloadTransportError: it was not delivered: the peer's connection closed (it died), or
            it did not take the frame within ``timeout`` (it is not serving its transport). The
            message names the peer rank and which of the two happened.
    """
    what = f"control frame to rank {peer}"
    with _peer_failures(what, peer, timeout):
        work = dist.isend(frame, peer, group=group)
        if work is None:  # pragma: no cover - isend returns work for a member rank
            raise PayloadTransportError("this rank is not in the payload control group")
        wait_collective([work], operation=what, timeout_s=timeout, ranks=(peer,))


def recv_frame(frame: torch.Tensor, peer: int, group: dist.ProcessGroup, timeout: float) -> None:
    """Receive the next control frame from ``peer`` into ``frame`` (a reader's idle wait,
    bounded by the control group's own ``timeout``).

    Raises:
        PayloadTransportError: the peer's connection closed (``cause="closed"``: it died) or
            nothing came within ``timeout`` (``cause="timeout"``); names the peer.
    """
    what = f"control frame from rank {peer}"
    start = time.monotonic()
    with _peer_failures(what, peer, timeout):
        try:
            dist.recv(frame, src=peer, group=group)
        except RuntimeError as exc:
            raise collective_failure(exc, what, (peer,), timeout, start) from exc


COALESCE_BYTES = 1 << 20
"""A transfer of at most this many bytes travels as one message: one concatenated buffer
instead of one per payload. Per-message cost dominates small payloads (gloo: tens of
microseconds each); the copy this costs is small at this size."""


def coalesce(buffers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One message for ``buffers`` if they are worth coalescing, else None.

    Every payload buffer's size is a multiple of the alignment, so each one starts aligned in
    the concatenation and the receiver can split it into views.
    """
    if len(buffers) < 2 or sum(b.numel() for b in buffers) > COALESCE_BYTES:
        return None
    return torch.cat(list(buffers))


# -- the payload buffer ------------------------------------------------------------------------

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack_payload(
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any] | None,
    device: torch.device,
) -> torch.Tensor:
    """Copy ``tensors`` and ``meta`` into one new flat ``uint8`` buffer on ``device``.

    Raises:
        TypeError / ValueError: a name is not a string, a value is not a dense tensor of a
            supported dtype, or ``meta`` is not JSON-serialisable. Nothing is allocated then.
    """
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"payload tensors must be a mapping of name to tensor, got {type(tensors).__name__}"
        )
    entries: list[list[Any]] = []
    offset = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"payload tensor names must be str, got {name!r}")
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(
                f"payload entry {name!r} must be a dense torch.Tensor, got {type(tensor).__name__}"
            )
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        if dtype_name not in _DTYPES:
            raise ValueError(
                f"payload entry {name!r} has unsupported dtype {tensor.dtype}; "
                f"supported: {', '.join(sorted(_DTYPES))}"
            )
        nbytes = tensor.numel() * tensor.element_size()
        entries.append([name, dtype_name, list(tensor.shape), offset, nbytes])
        offset = _aligned(offset + nbytes)
    try:
        manifest = json.dumps(
            {"meta": dict(meta or {}), "tensors": entries}, separators=(",", ":"), allow_nan=True
        ).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"payload metadata must be JSON-serialisable (small scalars, strings, "
            f"lists, dicts; send arrays as tensors): {exc}"
        ) from exc
    data_start = _aligned(8 + len(manifest))
    # offset is aligned after every tensor, so the whole buffer's size is aligned too.
    head = bytearray(data_start)
    head[:8] = len(manifest).to_bytes(8, "little")
    head[8 : 8 + len(manifest)] = manifest
    buffer = torch.empty(data_start + offset, dtype=torch.uint8, device=device)
    buffer[:data_start].copy_(torch.frombuffer(head, dtype=torch.uint8))
    for (_, _, _, start, nbytes), tensor in zip(entries, tensors.values(), strict=True):
        if nbytes:
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            buffer[data_start + start : data_start + start + nbytes].copy_(flat)
    return buffer


def unpack_payload(buffer: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors (views into ``buffer``, no copy) and metadata packed by :func:`pack_payload`.

    Raises:
        PayloadTransportError: the buffer is not a well-formed payload (a protocol bug).
    """
    try:
        length = int.from_bytes(buffer[:8].cpu().numpy().tobytes(), "little")
        manifest = json.loads(buffer[8 : 8 + length].cpu().numpy().tobytes())
        data_start = _aligned(8 + length)
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype_name, shape, start, nbytes in manifest["tensors"]:
            raw = buffer[data_start + start : data_start + start + nbytes]
            tensors[name] = raw.view(_DTYPES[dtype_name]).reshape(shape)
        meta: dict[str, Any] = manifest["meta"]
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise PayloadTransportError(
            f"received a malformed payload buffer of {buffer.numel()} bytes: {exc}"
        ) from exc
    return tensors, meta


# -- groups and work ---------------------------------------------------------------------------


def default_data_backend() -> str:
    """NCCL where CUDA and NCCL are there, gloo otherwise: one code path, two transports."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def device_for_group(group: dist.ProcessGroup, device: torch.device | str | None) -> torch.device:
    """The device payload buffers live on: as given, else CUDA's current device for NCCL."""
    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def transfer_p2p(
    ops: Sequence[dist.P2POp], device: torch.device, timeout: float, what: str, peer: int
) -> None:
    """Post ``ops`` (one transfer's sends or receives) and wait until they have *completed*
    (not merely been enqueued), within ``timeout`` s.

    On gloo ``wait`` returns on completion. On NCCL it only makes the current stream wait, so
    an event recorded after it is polled: the transfer is complete when the event is.

    Raises:
        PayloadTransportError: posting or the work failed (the peer's connection closed,
            ``cause="closed"``); :class:`~rollout_sync.errors.PayloadPeerTimeout`: it did not
            complete in time. Both name ``peer``. The data group is unusable afterwards (a
            timed-out gloo pair is closed; an NCCL op is stuck).
    """
    deadline = deadline_after(timeout)
    with _peer_failures(what, peer, timeout):
        works = dist.batch_isend_irecv(list(ops))
        wait_collective(works, operation=what, timeout_s=timeout, ranks=(peer,))
        if device.type == "cuda":
            wait_device_idle(
                deadline,
                lambda: CollectiveTimeout(
                    f"{what}: device work still running after {timeout:.1f} s",
                    operation=what,
                    group=(peer,),
                    timeout=timeout,
                ),
            )


@contextmanager
def _peer_failures(what: str, peer: int, timeout: float) -> Iterator[None]:
    """Turn a failed wait on ``peer`` into :class:`PayloadTransportError`, naming the peer and
    the cause: its connection closed (it died) or it took nothing within ``timeout``."""
    try:
        yield
    except CollectiveTimeout as exc:
        raise PayloadPeerTimeout(
            f"{what} did not complete within {timeout:.1f} s: rank {peer} stopped serving its "
            "transport or hung; the transport is unusable now",
            peer=peer,
            cause="timeout",
        ) from exc
    except (CollectiveError, RuntimeError) as exc:  # RuntimeError: the send itself refused
        raise PayloadTransportError(
            f"{what} failed: the connection to rank {peer} closed (the peer most likely died; "
            f"check its log); the transport is unusable now: {exc}",
            peer=peer,
            cause="closed",
        ) from exc


def use_device(device: torch.device) -> None:
    """Make ``device`` current on the calling thread: NCCL works on the thread's current
    device, and a new thread starts on device 0 whatever the process set."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


# -- what both ends share ----------------------------------------------------------------------


class _EndState(Protocol):
    """What an end's bookkeeping offers the shared machinery."""

    @property
    def error(self) -> BaseException | None:
        """The first failure, if a thread failed."""
        ...

    def fail(self, exc: BaseException) -> None:
        """Keep ``exc`` unless a failure is kept already."""
        ...

    def flush_target(self) -> int | None:
        """The ticket a flush called now must see finish (None: nothing is in flight)."""
        ...

    def flushed(self, target: int) -> bool: ...


class TransportEnd:
    """What the sender and the receiver share: a lock, a failure that sticks, bounded waits.

    Each end runs daemon threads that share one lock, and conditions on it, with the callers.
    A thread that dies records its exception with :meth:`_fail`, which wakes every waiter;
    from then on every call raises :class:`PayloadTransportError` chained to it. Every wait
    runs to a deadline; ``timeout=None`` means ``default_timeout``, ``math.inf`` for ever.

    A subclass calls ``__init__`` first, then sets ``_state`` (its bookkeeping, which keeps the
    failure: ``error`` and ``fail``) and ``_conditions`` (every condition a caller or a thread
    may wait on), and provides ``_begin_hold`` / ``_end_hold`` (its bookkeeping of a hold, see
    :meth:`_hold`).
    """

    _state: _EndState
    _conditions: tuple[threading.Condition, ...]
    _progress: threading.Condition
    """Flushes wait here for transfers to finish."""

    def __init__(
        self,
        *,
        name: str,
        default_timeout: float,
        hold_timeout_error: type[GateTimeout],
        failure_subject: str,
    ) -> None:
        if not default_timeout > 0:
            raise ValueError(f"default_timeout must be > 0 seconds, got {default_timeout!r}")
        self.default_timeout = default_timeout
        # Private: the bookkeeping counts every hold, so a hold must come through _hold.
        self._gate = Gate.for_payloads(
            "payload transfer", timeout=default_timeout, name=name, timeout_error=hold_timeout_error
        )
        self._lock = threading.Lock()
        self._failure_subject = failure_subject

    # -- the hold ------------------------------------------------------------------------------

    @contextmanager
    def _hold(self, timeout: float | None) -> Iterator[None]:
        """Hold this end's payload transfers for the ``with`` body (``hold_sends`` and
        ``hold_receives``).

        The hold is counted in the bookkeeping first, so that the end starts no transfer while
        the gate closes; closing waits for the transfer in flight. A gate that does not close
        within ``timeout`` raises its ``timeout_error``, and nothing is held then.
        """
        self._begin_hold()
        try:
            self._gate.acquire_exclusive(timeout)
        except BaseException:
            self._end_hold()
            raise
        try:
            yield
        finally:
            self._gate.release_exclusive()
            self._end_hold()

    def _begin_hold(self) -> None:
        raise NotImplementedError

    def _end_hold(self) -> None:
        raise NotImplementedError

    # -- waiting -------------------------------------------------------------------------------

    def _deadline(self, timeout: float | None) -> tuple[float, float]:
        """The limit ``timeout`` stands for (None: the default) and its deadline.

        Raises:
            ValueError: a negative or NaN timeout.
        """
        limit = limit_of(timeout, self.default_timeout)
        return limit, deadline_after(limit)

    def _wait_until(
        self,
        condition: threading.Condition,
        ready: Callable[[], bool],
        deadline: float,
        operation: str,
        timed_out: Callable[[], BaseException],
    ) -> None:
        """Wait on ``condition`` (the caller holds the lock) until ``ready()``.

        Raises:
            PayloadTransportError: the transport failed before ``ready()`` (names ``operation``).
            ``timed_out()``: ``deadline`` passed first; built then, so it can say what is stuck.
        """
        while not ready():
            self._raise_if_failed(operation)
            if expired(deadline):
                raise timed_out()
            condition.wait(wait_arg(deadline))

    def _flush(
        self,
        timeout: float | None,
        operation: str,
        timed_out: Callable[[float], BaseException],
    ) -> None:
        """Return once the transfers in flight at the call have completed (``flush_pending_*``);
        ``timed_out(limit)`` is raised if they did not within ``timeout``."""
        limit, deadline = self._deadline(timeout)
        with self._lock:
            target = self._state.flush_target()
            if target is not None:
                self._wait_until(
                    self._progress,
                    lambda: self._state.flushed(target),
                    deadline,
                    operation,
                    lambda: timed_out(limit),
                )

    # -- failure -------------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        """Keep the first failure and wake every waiter, so that it raises it."""
        with self._lock:
            self._state.fail(exc)
            for condition in self._conditions:
                condition.notify_all()

    def _raise_if_failed(self, operation: str) -> None:
        error = self._state.error
        if error is not None:
            # The peer and cause of the failure travel on, for code that tells them apart.
            kind = PayloadPeerTimeout if isinstance(error, PayloadPeerTimeout) else None
            raise (kind or PayloadTransportError)(
                f"cannot {operation}: {self._failure_subject} failed "
                f"({type(error).__name__}: {error})",
                peer=getattr(error, "peer", None),
                cause=getattr(error, "cause", None),
            ) from error
