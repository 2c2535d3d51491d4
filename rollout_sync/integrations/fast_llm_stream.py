"""The Fast-LLM trainer's weight stream as a weight transfer: what a
:class:`~rollout_sync.integrations.fast_llm.FastLLMReceiver` hands its install strategy.

:class:`FastLLMStream` receives one version (the one :meth:`FastLLMStream.expect` names) from
the trainer's broadcast group into whatever target the strategy gives it, as the package's
:class:`~rollout_sync.WeightTransfer` does into served tensors or a staging copy. The stream has
no manifest, so each header is checked against the target as it arrives (name, shape, dtype);
a refused tensor is still received (to stay in step with the trainer) and the version refused
at the end marker, every problem listed at once. A malicious or oversized header, or a trainer
that dies or stalls mid-stream, abandons the stream: the receiver leaves the group
(``on_broken``).

Where the bytes go:

* into the target as each header is accepted, when the target is a buffer (a staging copy:
  ``write_kind=BUFFER_WRITE``) or ``stage=False`` (no second copy): a failure after a write
  into served tensors raises :class:`~rollout_sync.errors.WeightTransferError` with
  ``tensors_written``, and the strategy marks them torn;
* else (``stage=True`` into served tensors, generation paused) into buffers of the stream's own,
  written into the target after the end marker, once every check passed.

A tensor that arrives shorter than its header (gloo completes such a receive silently) is
caught by :class:`_TailSentinels`.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RolloutSyncError, UnsafeHeaderError, WeightMismatchError, WeightTransferError
from ..trace import SpanKind, Timeline
from ..transfer import BUFFER_WRITE, OriginChecksums, TransferStats
from ..transfer.delta_sync import DeltaTarget, EncodedDelta, WholeReason
from .fast_llm_wire import BroadcastGroup, TensorHeader, WeightsReady, decode_header

__all__ = ["FastLLMStream"]

_SENTINEL_CHECK_BYTES = 8
"""A received tensor whose last 8 bytes still hold the sentinel arrived short (an honest one
holds it by chance with probability 2**-64)."""
_SENTINEL_SPAN_BYTES = 1 << 14
"""How much of a receive buffer's tail the sentinel covers: a shortfall up to 16 KiB is counted
to the byte in the error, a longer one as "at most". Kept under torch's parallel grain (a
64 KiB ``uint8`` copy took 16 ms on two busy cores, against microseconds for 16 KiB)."""


class FastLLMStream:
    """The trainer's broadcast group, as a receive-only weight transfer (see the module).

    Args:
        group: the joined group.
        max_header_bytes: the longest header accepted.
        stage: into served tensors, receive into buffers of its own and write after the end
            marker (``False``: straight in).
        timeline: records the writes.
        on_broken: called when the stream is abandoned (the receiver leaves the group).
    """

    delta_syncs = False
    """Fast-LLM's wire sends whole tensors: every sync over it is whole."""

    def __init__(
        self,
        group: BroadcastGroup,
        *,
        max_header_bytes: int,
        stage: bool,
        timeline: Timeline | None,
        on_broken: Callable[[], None],
    ) -> None:
        self.group = group
        self.max_header_bytes = max_header_bytes
        self.stage = stage
        self.timeline = timeline
        self.on_broken = on_broken
        self.event: WeightsReady | None = None
        self.dropped = 0
        """Tensors of other shards received and dropped by the last receive."""
        self._served_written = 0
        """Served tensors the last receive wrote (counted before each write)."""

    def __repr__(self) -> str:
        return f"<FastLLMStream {self.group.backend} rank {self.group.rank}>"

    @property
    def is_source(self) -> bool:
        """Never: the trainer sends."""
        return False

    @property
    def backend(self) -> str:
        """The group's backend: what the NCCL rule reads."""
        return self.group.backend

    def expect(self, event: WeightsReady) -> None:
        """The version the next :meth:`receive` takes (the trainer's ``weights_ready``)."""
        self.event = event

    def receive(
        self,
        into: Mapping[str, torch.Tensor],
        *,
        allow_subset: bool = True,
        write_kind: str = SpanKind.WEIGHT_WRITE,
        storage: torch.Tensor | None = None,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        delta: DeltaTarget | None = None,
    ) -> TransferStats:
        """Receive the expected version into ``into`` (``storage``, ``verify`` and ``delta``
        unused: Fast-LLM's wire sends whole tensors, so every sync over it is whole).

        Raises:
            WeightMismatchError: the version was refused (received in full); nothing of it is
                in served tensors.
            UnsafeHeaderError / CollectiveError (and the like): the stream was abandoned (the
                group is left); nothing of it is in served tensors.
            WeightTransferError: either of the above after a write into served tensors (its
                cause chained; a refusal's WeightMismatchError too): they are torn.
        """
        event = self.event
        if event is None:
            raise RolloutSyncError("FastLLMStream.receive before expect(event)")
        start = time.perf_counter()
        self._served_written = 0
        served = write_kind != BUFFER_WRITE
        direct = not served or not self.stage
        staged, nbytes = self._stream_into(into, event, direct, served, allow_subset, write_kind)
        if not direct:
            self._write(staged, into, event, write_kind)
        end = time.perf_counter()
        return TransferStats.build(
            role="receive",
            version=event.version,
            tensors=len(staged),
            buckets=len(staged),  # the stream sends a tensor a message
            nbytes=nbytes,
            manifest_s=0.0,  # no manifest: each header is checked as it comes
            transfer_s=end - start,
            total_s=end - start,
            tensors_written=len(staged),
        )

    def wrote_nothing(self, error: BaseException) -> bool:
        """Whether the receive that raised ``error`` left every served tensor untouched (its
        own errors, raised before any write: a refusal, an unsafe header, a death
        mid-stream with the tensors in its buffers)."""
        return self._served_written == 0

    def relay(
        self,
        into: Mapping[str, torch.Tensor],
        forward: FastLLMStream,
        *,
        allow_subset: bool = True,
        write_kind: str = SpanKind.WEIGHT_WRITE,
        storage: torch.Tensor | None = None,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        delta: DeltaTarget | None = None,
    ) -> TransferStats:
        """Refused: the stream is received, then passed on R2R by the package's transfer."""
        raise RolloutSyncError("the Fast-LLM stream is received, not relayed: use r2r")

    def send(
        self,
        weights: Mapping[str, torch.Tensor],
        *,
        version: int,
        require_all: bool = True,
        origin: OriginChecksums | None = None,
        storage: torch.Tensor | None = None,
        delta: EncodedDelta | WholeReason | None = None,
    ) -> TransferStats:
        """Refused: the trainer sends."""
        raise RolloutSyncError("the Fast-LLM stream is the trainer's to send")

    def abort(self, reason: str, *, version: int | None = None) -> None:
        """Refused: only the trainer aborts its stream."""
        raise RolloutSyncError("the Fast-LLM stream is the trainer's to abort")

    # -- the stream -------------------------------------------------------------------------

    def _stream_into(
        self,
        into: Mapping[str, torch.Tensor],
        event: WeightsReady,
        direct: bool,
        served: bool,
        allow_subset: bool,
        write_kind: str,
    ) -> tuple[dict[str, torch.Tensor], int]:
        """Receive one whole stream and check it: each accepted tensor straight into ``into``
        (``direct``) or into a buffer of its own. Returns (the accepted tensors by name, bytes
        received); :attr:`dropped` counts the other shards' tensors."""
        group = self.group
        # A tensor is received even when refused (to stay in step with the trainer), but no
        # allocation is made for more than 8x the largest target tensor (float64 for float8).
        largest = 8 * max((t.numel() * t.element_size() for t in into.values()), default=0)
        staged: dict[str, torch.Tensor] = {}
        came: set[str] = set()  # target names whose tensor came, accepted or refused
        problems: list[str] = []
        sentinels = _TailSentinels(event.step)
        written = dropped = nbytes = 0
        drop: torch.Tensor | None = None  # where dropped tensors are received, reused
        what = f"Fast-LLM weights of step {event.step}"
        try:
            length = torch.zeros(1, dtype=torch.int64, device=group.device)
            while True:
                group.receive(length, f"{what}: header length")
                n = int(length.item())
                if not 0 < n <= self.max_header_bytes:
                    raise UnsafeHeaderError(
                        f"{what}: a header of {n} bytes (the receiver accepts 1 .. "
                        f"{self.max_header_bytes})"
                    )
                raw = torch.empty(n, dtype=torch.uint8, device=group.device)
                group.receive(raw, f"{what}: header")
                header = decode_header(raw.cpu().numpy().tobytes())
                if header is None:
                    break
                if header.nbytes > largest:
                    raise UnsafeHeaderError(
                        f"{what}: {header.name} ({header.shard}) announces {header.nbytes} bytes, "
                        f"more than 8x any served tensor ({largest})"
                    )
                if header.shard == "weights" and header.name in into:
                    came.add(header.name)
                target, problem = self._target(header, into, staged, direct)
                if problem is not None:
                    problems.append(problem)
                if target is None:  # another shard, or refused: received to stay in step
                    if drop is None or drop.numel() < header.nbytes:  # one buffer, grown
                        drop = torch.empty(header.nbytes, dtype=torch.uint8, device=group.device)
                    scratch = drop[: header.nbytes].view(header.dtype).view(header.shape)
                    sentinels.arm(scratch, header)
                    group.receive(scratch, f"{what}: {header.name}")
                    dropped += header.shard != "weights"
                elif not direct:
                    armed = sentinels.arm(target, header)
                    group.receive(target, f"{what}: {header.name}")
                    sentinels.watch(armed)
                    staged[header.name] = target
                else:
                    with self._write_span(header.name, write_kind):
                        written += 1  # counted first: a failed receive leaves it half-written
                        self._served_written += served
                        armed = sentinels.arm(target, header)
                        group.receive(target, f"{what}: {header.name}")
                    sentinels.watch(armed)
                    staged[header.name] = target
                nbytes += header.nbytes
        except BaseException as exc:
            self.on_broken()  # out of step with the trainer (or it is gone): leave the group
            if written and served and isinstance(exc, Exception):
                why = f"the stream failed. {type(exc).__name__}: {exc}"
                raise _torn(event, written, why) from exc
            raise
        self.dropped = dropped
        problems.extend(sentinels.shortfalls())
        missing = [] if allow_subset else sorted(set(into) - came)
        if missing:
            problems.append(
                f"{len(missing)} served tensor(s) did not come: {', '.join(missing[:5])}"
                + (" ..." if len(missing) > 5 else "")
            )
        if problems:
            if written and served:  # the problems, listed once, are the cause (its .problems)
                refused = WeightMismatchError(problems, context=f"{what}: refused")
                why = f"refused at the end marker ({len(problems)} problem(s)); see the cause"
                raise _torn(event, written, why) from refused
            raise WeightMismatchError(problems, context=f"{what}: refused, nothing written")
        return staged, nbytes

    def _target(
        self,
        header: TensorHeader,
        into: Mapping[str, torch.Tensor],
        staged: Mapping[str, torch.Tensor],
        direct: bool,
    ) -> tuple[torch.Tensor | None, str | None]:
        """Where to receive ``header``'s tensor, or ``None`` (drop) and why it is refused."""
        if header.shard != "weights":
            return None, None
        tensor = into.get(header.name)
        if tensor is None:
            return None, f"{header.name}: not a served weight"
        if header.name in staged:
            return None, f"{header.name}: sent twice"
        if tuple(tensor.shape) != header.shape or tensor.dtype != header.dtype:
            return None, (
                f"{header.name}: announced {list(header.shape)} {header.dtype}, served "
                f"{list(tensor.shape)} {tensor.dtype}"
            )
        if direct:
            return tensor, None
        return torch.empty(header.shape, dtype=header.dtype, device=self.group.device), None

    def _write(
        self,
        staged: Mapping[str, torch.Tensor],
        into: Mapping[str, torch.Tensor],
        event: WeightsReady,
        write_kind: str,
    ) -> None:
        """Write a complete, accepted version into ``into``.

        Raises:
            WeightTransferError: a copy failed part-way (its cause chained).
        """
        written = 0
        try:
            with torch.no_grad():
                for name, tensor in staged.items():
                    with self._write_span(name, write_kind):
                        written += 1  # counted first: a failed copy leaves it half-written
                        self._served_written += 1
                        into[name].copy_(tensor)
        except Exception as exc:
            why = f"a copy failed. {type(exc).__name__}: {exc}"
            raise _torn(event, written, why) from exc

    def _write_span(self, name: str, kind: str) -> AbstractContextManager[Any]:
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.span(kind, name)


def _torn(event: WeightsReady, written: int, why: str) -> WeightTransferError:
    """The error of a version that failed after ``written`` served tensors were written (the
    strategy marks them torn: :func:`~rollout_sync.sync.slot.settle_failed_receive`)."""
    return WeightTransferError(
        f"Fast-LLM weights of step {event.step}: {why}; {written} served tensor(s) were written "
        "before, so the served weights are torn: generation stays parked until a complete "
        "version lands",
        operation=f"receive Fast-LLM weights of step {event.step}",
        version=event.version,
        tensors_written=written,
    )


@dataclass(frozen=True)
class _Armed:
    """A receive buffer whose tail holds the sentinel of ``header``'s tensor."""

    header: TensorHeader
    raw: torch.Tensor
    """The buffer's bytes (a flat ``uint8`` view)."""
    tile: torch.Tensor
    """The sentinel bytes written over the last ``tile.numel()`` of them."""


class _TailSentinels:
    """Catches a tensor that arrives shorter than its header announced.

    On gloo a broadcast whose sender sends fewer bytes than the receive buffer holds completes
    without an error, writing the front of the buffer only, and the stream stays in step (the
    next receive gets the next frame); the protocol has no checksum. So before each receive
    :meth:`arm` writes a pattern over the buffer's tail (its last 16 KiB at most), and after the
    end marker :meth:`shortfalls` names every tensor whose last 8 bytes still hold it.

    The pattern is the 8-byte blake2b digest of the version's step and the tensor's shard and
    name, repeated:

    * every receiver derives the same one: gloo's broadcast is a tree, and a receiver relays its
      whole buffer, pattern included, to the next, which must recognise it (a pattern drawn at
      random by each receiver would pass a relayed short tensor as complete);
    * it is unrelated to weight values and new for every tensor and version, so an honest
      tensor's last 8 bytes equal it with probability 2**-64 whatever the values are (a fixed
      pattern, a NaN payload or zeros, coincides with real weights), and a coincidence does not
      repeat at the next version.

    No check of the received bytes can be exact: a tensor short by ``d`` bytes differs from an
    honest one only in the ``d`` bytes the sender never wrote, so catching every ``d``-byte
    shortfall would refuse honest tensors with probability ``256**-d``. A shortfall of 8 bytes
    or more is always caught; a smaller one (under two float32 elements) is not. A tensor of
    fewer than 8 bytes is checked over all its bytes.

    Bookkeeping only (the receives are the caller's): nothing here waits for the device before
    :meth:`shortfalls`, which reads every check in one transfer.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self._watched: list[tuple[_Armed, torch.Tensor]] = []
        """Per tensor to be written: its armed buffer and a 0-dim bool on its device, true
        when its last bytes still held the pattern after the receive."""

    def arm(self, buffer: torch.Tensor, header: TensorHeader) -> _Armed:
        """Write ``header``'s pattern over the tail of ``buffer`` (contiguous), before the
        receive into it. Every receive is armed, refused and dropped tensors too: a receiver
        relays its buffer down gloo's tree."""
        raw = buffer.view(-1).view(torch.uint8)
        span = min(raw.numel(), _SENTINEL_SPAN_BYTES)
        digest = hashlib.blake2b(
            f"{self.step}/{header.shard}/{header.name}".encode(), digest_size=8
        ).digest()
        word = int.from_bytes(digest, sys.byteorder, signed=True)
        tile = torch.full((-(-span // 8),), word, dtype=torch.int64, device=raw.device)
        armed = _Armed(header, raw, tile.view(torch.uint8)[:span])
        if span:
            with torch.no_grad():
                raw[raw.numel() - span :].copy_(armed.tile)
        return armed

    def watch(self, armed: _Armed) -> None:
        """After the receive into ``armed``'s buffer (a tensor to be written): note whether its
        last bytes still hold the pattern."""
        n = armed.raw.numel()
        if n:
            width = min(n, _SENTINEL_CHECK_BYTES)
            span = armed.tile.numel()
            flag = (armed.raw[n - width :] == armed.tile[span - width :]).all()
            self._watched.append((armed, flag))

    def shortfalls(self) -> list[str]:
        """One problem per watched tensor that arrived short, naming it and the byte counts."""
        if not self._watched:
            return []
        device = self._watched[0][1].device
        short = torch.stack([flag.to(device) for _, flag in self._watched]).tolist()
        return [_shortfall(armed) for (armed, _), s in zip(self._watched, short, strict=True) if s]


def _shortfall(armed: _Armed) -> str:
    """What arrived of ``armed``'s tensor: the bytes before the last one that differs from the
    pattern (rounded up to whole elements: a real byte equal to the pattern's is counted as
    missing, with probability ``256**-element_size``)."""
    header, raw, tile = armed.header, armed.raw, armed.tile
    n, span = raw.numel(), tile.numel()
    differs = (raw[n - span :] != tile).nonzero()
    if differs.numel():
        element = header.dtype.itemsize
        arrived = n - span + int(differs[-1]) + 1
        arrived = min(-(-arrived // element) * element, n - min(n, _SENTINEL_CHECK_BYTES))
        count = f"{arrived} of the {n} bytes"
    else:
        count = f"{'at most ' if n > span else ''}{n - span} of the {n} bytes"
    return (
        f"{header.name}: {count} its header announces arrived ({list(header.shape)} "
        f"{header.dtype}): the trainer sent a shorter tensor"
    )
