"""The host copy a ``"rollout_sync"`` vLLM worker engine takes delta syncs on (docs/vllm.md,
"Delta syncs"): the served weights on the host, and how a delta's whole tensors are rebuilt
from it for vLLM's loader.

vLLM for CPU repacks and replaces its linear weights after loading, so a delta cannot be
applied to what the engine serves. :class:`HostCopy` keeps the served weights in the dtype the
trainer sends, refreshed from the tensors every whole update hands the loader, and says which
version it holds (``None`` whenever it cannot vouch for one). :class:`DeltaLoad` is one delta's
load: each rebuilt tensor goes to the loader with the parts of its fused module that the delta
does not change (vLLM rebuilds a fused module from all of its parts). The engine
(:mod:`~rollout_sync.backends.vllm.engine`) decides when either is used.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ...transfer.delta import apply_changes
from ...transfer.delta_sync import DeltaTarget, DigestCache, ReceivedDelta

__all__ = ["DeltaLoad", "FusedParts", "HostCopy"]


@dataclass
class HostCopy:
    """The weights a worker serves, on the host, in the dtype the trainer sends: what a delta
    is applied to and whole tensors are rebuilt from (vLLM for CPU repacks what it serves).

    Written by a whole update from the tensors it hands the loader, and by a delta proven
    against it; read by the transfer (a delta's checks and proof) and the rebuild.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int | None = None
    """The version every tensor holds and the engine serves, verified by its read-back;
    ``None`` (no complete copy, an update in progress or failed): a delta gets a vote for the
    whole version."""
    digests: DigestCache = field(default_factory=DigestCache)
    """Each tensor's digest, per version: taken once after a whole update, moved by deltas."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def refresh(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Copy tensors a whole update loads (reusing the buffer of a name while its shape
        and dtype are unchanged). Their cached digests are forgotten: a version number may
        come again with other bits (a restarted trainer)."""
        for name, tensor in zip(names, tensors, strict=True):
            self.digests.digests.pop(name, None)
            kept = self.tensors.get(name)
            if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
                self.tensors[name] = tensor.detach().to("cpu", copy=True)
            else:
                kept.copy_(tensor.detach())

    def covers(self, names: Mapping[str, torch.Tensor]) -> bool:
        """Whether it holds a tensor of every name (of each one's shape and dtype)."""
        return all(
            n in self.tensors
            and self.tensors[n].shape == t.shape
            and self.tensors[n].dtype == t.dtype
            for n, t in names.items()
        )

    def target(self, served: Mapping[str, torch.Tensor], *, apply: bool) -> DeltaTarget | None:
        """This copy as a delta sync's target, or ``None`` (a vote for the whole version): it
        holds no version, or not every ``served`` name."""
        if self.version is None or not self.covers(served):
            return None
        return DeltaTarget(self.tensors, self.version, self.digests, apply=apply)

    def rebuilt(
        self, delta: ReceivedDelta, limit: int
    ) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
        """The whole tensors ``delta`` changes, rebuilt from this copy (which it leaves as it
        is), in chunks of about ``limit`` bytes: copies, which vLLM's reload keeps."""
        chunk: list[str] = []
        size = 0
        for name in [*delta.changes, None]:
            if chunk and (name is None or size >= limit):
                tensors = [self.tensors[n].clone() for n in chunk]
                for n, rebuilt in zip(chunk, tensors, strict=True):
                    apply_changes(rebuilt, *delta.changes[n])
                yield chunk, tensors
                chunk, size = [], 0
            if name is not None:
                chunk.append(name)
                size += self.tensors[name].numel() * self.tensors[name].element_size()

    def commit(
        self, pending: ReceivedDelta | None, version: int | None, served: Mapping[str, torch.Tensor]
    ) -> None:
        """An update landed (verified): write ``pending`` (a staged delta, proven against this
        copy), then hold ``version`` where this copy has every ``served`` name. It claims no
        version while it is written; a write that failed (of any kind: the engine landed, only
        the copy is behind) empties it, so that no later update claims a version for tensors
        left behind (a delta's unchanged fused parts are loaded from here unproven) until a
        whole update of every served name refilled it. An error that is no ``Exception`` is
        raised on."""
        self.version = None
        if pending is not None:
            try:
                pending.apply(self.digests)  # proven already
            except BaseException as exc:
                self.tensors, self.digests = {}, DigestCache()
                if not isinstance(exc, Exception):
                    raise
                return
        self.version = version if self.covers(served) else None


@dataclass(frozen=True)
class FusedParts:
    """Which checkpoint names vLLM loads into one fused module (``q_proj``, ``k_proj`` and
    ``v_proj`` into ``qkv_proj``)."""

    groups: Mapping[str, str]
    """Each fused part's group (names outside any group are absent)."""
    members: Mapping[str, list[str]]
    """Each group's parts."""

    @classmethod
    def of(cls, groups: Mapping[str, str]) -> FusedParts:
        members: dict[str, list[str]] = {}
        for name, group in groups.items():
            members.setdefault(group, []).append(name)
        return cls(groups, members)

    def around(self, name: str) -> list[str]:
        """Every part of the fused module ``name`` loads into (``[]``: none)."""
        group = self.groups.get(name)
        return [] if group is None else self.members[group]

    def closure(self, names: set[str]) -> set[str]:
        """``names`` and every other part of the fused modules they load into."""
        out = set(names)
        for name in names:
            out.update(self.around(name))
        return out


@dataclass
class DeltaLoad:
    """One delta's load into the model: the names it changes, and those handed so far."""

    host: HostCopy
    changed: set[str]
    fused: FusedParts
    loaded: set[str] = field(default_factory=set)

    def with_unchanged_parts(
        self, names: list[str], tensors: list[torch.Tensor]
    ) -> tuple[list[str], list[torch.Tensor]]:
        """Rebuilt tensors, each followed by the parts of its fused module that the delta does
        not change (copies from the host copy; each loaded once: a changed part comes with
        its own rebuilt tensor)."""
        out_names: list[str] = []
        out_tensors: list[torch.Tensor] = []
        for name, tensor in zip(names, tensors, strict=True):
            out_names.append(name)
            out_tensors.append(tensor)
            self.loaded.add(name)
            for part in self.fused.around(name):
                if part not in self.changed and part not in self.loaded:
                    out_names.append(part)
                    out_tensors.append(self.host.tensors[part].clone())
                    self.loaded.add(part)
        return out_names, out_tensors
