"""A refit cost model: how long a weight sync takes, and how long it stalls generation, at a scale.

A sync is built from parts, and so is its time: links (bandwidth and latency: a NIC, NVLink),
the software cost of each collective on the critical path, the manifest's validation, copies
(packing a bucket, unpacking it, installing staged weights), checksums, the park (one decode
step) and the votes. :func:`estimate` composes them for one :class:`Topology` and one
:class:`Scenario` and returns a :class:`RefitEstimate`: the refit (from the trainer's push until
every replica serves the new version), the generation stall, the bytes on the busiest link, and
where the time goes (:class:`Phase`).

The rules, in order of importance:

1. **Buckets flow through stages.** Each bucket passes a chain of :class:`Stage` s (the source's
   pack, the link, a relay's hand-off, the next link, the receiver's unpack), one bucket at a
   time per stage, so stage ``i`` works on bucket ``k`` while stage ``i + 1`` works on ``k - 1``
   (:func:`pipeline`: ``done[i][k] = max(done[i-1][k], free[i]) + busy[i][k] + latency[i]``,
   the flow-shop recurrence). A stage that writes into ``buffers`` reusable buffers waits until
   a later stage (``freed_by``) delivered the bucket that last used its buffer: the source's
   two alternating staging buffers, each reused once the link delivered its bucket.
2. **Control collectives are in series.** The manifest header and the manifest (broadcasts),
   the manifest vote and the commit vote (all-gathers): each costs the link's latency, its bytes
   over the link, and :attr:`SyncCosts.collective_s`. A receiver validates the manifest
   (:attr:`SyncCosts.manifest_s_per_tensor` per tensor) before it votes.
3. **Topologies** (:class:`Topology`). *One source*: P2R (the trainer to the first replica),
   and after it, R2R (the first replica broadcasts to the others): two hops in series. *The
   pipelined relay*: the first replica passes each bucket on as it arrives, so the two hops
   overlap: one pipeline of [pack, P2R link, hand-off, R2R link, unpack]. *Sharded, two hops*
   (:class:`~rollout_sync.transfer.ShardedTransfer`): every trainer rank sends its own regions
   point to point, each replica GPU receives only its shard (a plan vote, the buckets, a
   commit vote), the first link's load ``max(bytes / trainer ranks, bytes / replica GPUs)``
   (the busiest trainer rank's egress or replica GPU's ingress); then, once that is complete,
   R2R GPU ``k`` to GPU ``k``: each of the first replica's GPUs broadcasts its shard to the
   same GPU of the others. *Sharded, pipelined* (``ShardedTransfer(pipelined_relay=True)``):
   the same first hop, the second overlapped with it: the pipelined relay, per GPU, forwarding
   in granules of :attr:`Scenario.sources_per_gpu` buckets, two-phase.
   A broadcast is as :attr:`Scenario.broadcast` says (:class:`Broadcast`). By default a
   bandwidth-optimal chain, as NCCL runs one: the source's link carries the bytes once,
   whatever the group's size. Gloo (``ProcessGroupGloo`` on CPU tensors runs
   ``gloo::broadcast``) sends a binomial tree of whole messages instead: the root sends
   ``ceil(log2 n)`` full copies to a group of ``n``, one after another, and a member forwards
   only what it received whole, so the broadcast is one link at ``rate / ceil(log2 n)`` with
   ``floor(log2 n)`` latencies. Measured here (``benchmarks/gloo_broadcast.py``, torch 2.13:
   the bytes each process wrote to its sockets during a 67 MB broadcast): the root wrote 1.0
   copy to 1 receiver, 2.0 to 2, 2.0 to 3 (and the first receiver forwarded 1.0 to the
   third).
4. **Staged or in place.** In place, generation parks first and the transfer writes the served
   tensors: the stall is the park and the whole transfer. Staged, the transfer lands in a
   staging area while generation goes on; the stall is the park and the install (a copy of the
   replica's bytes per GPU, :attr:`SyncCosts.install_bytes_per_s`).

What is not modelled: one-time costs (communicator setup, memory registration, the first
manifest's encoding, which both sides cache), receiver-side format conversion, ingress
contention beyond the sharded designs' first link (the busiest side's total at one link's rate,
not the order in which sources burst into a GPU), the elements a replica's GPUs all hold (a
replicated norm weight: sent once per GPU), and failures.

``benchmarks/scale.py`` checks the model against real transfers on one machine with an emulated
NIC (:mod:`rollout_sync.testing.emulated_nic`) and extrapolates it to :data:`FLEET_1T`;
docs/scale.md shows both.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

__all__ = [
    "FLEET_1T",
    "Broadcast",
    "Fleet",
    "Link",
    "Phase",
    "PipelineRun",
    "RefitEstimate",
    "Scenario",
    "Stage",
    "SyncCosts",
    "Topology",
    "estimate",
    "pipeline",
    "tree_depth",
]


@dataclass(frozen=True)
class Link:
    """One direction of a link: its rate in bytes per second and its one-way latency."""

    rate_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.rate_bytes_per_s > 0:
            raise ValueError(f"a link's rate must be > 0 bytes/s, got {self.rate_bytes_per_s!r}")
        if not self.latency_s >= 0:
            raise ValueError(f"a link's latency must be >= 0 s, got {self.latency_s!r}")

    def seconds(self, nbytes: float) -> float:
        """Time for ``nbytes`` to arrive: the latency plus the bytes at the rate."""
        return self.latency_s + nbytes / self.rate_bytes_per_s


class Broadcast(enum.Enum):
    """How a broadcast's bytes travel through its group, and so what each link carries.

    Both send every member the whole message; they differ in who sends how many copies, and
    in how many link latencies the last member waits (:meth:`link` folds both into one link).
    """

    CHAIN = "chain"
    """A bandwidth-optimal chain, pipelined in chunks, as NCCL runs one: every link carries
    the bytes once, whatever the group's size; one latency (the chunks overlap the hops)."""
    GLOO = "gloo"
    """``gloo::broadcast`` (what ``ProcessGroupGloo`` runs for CPU tensors): a binomial tree of
    whole messages. In round ``i`` every member that has the message sends all of it to the
    member ``2**i`` ranks further (counting from the root); a member forwards only once it
    received the whole message. The root sends ``ceil(log2 n)`` copies to a group of ``n``,
    the busiest link; the deepest member is ``floor(log2 n)`` hops away."""

    def copies(self, members: int) -> int:
        """Full copies the busiest member's link sends in a broadcast to ``members`` (the
        source included): 1 for a chain, ``ceil(log2 members)`` for gloo's tree."""
        if members < 2:
            return 0
        return 1 if self is Broadcast.CHAIN else math.ceil(math.log2(members))

    def hops(self, members: int) -> int:
        """Link latencies before the last member has the message: 1 for a chain,
        ``floor(log2 members)`` for gloo's tree (each hop a whole message's store and
        forward)."""
        if members < 2:
            return 0
        return 1 if self is Broadcast.CHAIN else int(math.log2(members))

    def link(self, link: Link, members: int) -> Link:
        """The broadcast to ``members`` over ``link`` as one link: ``copies`` messages through
        the busiest sender at ``link``'s rate, then ``hops`` latencies. Exact for a chain. For
        gloo's tree the root's copies are the bottleneck of a stream of messages, and the last
        member has a message ``copies`` messages and ``hops`` latencies after the root began
        it when one member is both deepest and served in the last round (groups of 2-4, 6-8,
        12-16, ...); in other groups (5, 9-11, ...) that is an upper bound: the deepest member
        is served earlier, the last-served one nearer."""
        copies = max(1, self.copies(members))
        return Link(link.rate_bytes_per_s / copies, link.latency_s * max(1, self.hops(members)))


@dataclass(frozen=True)
class SyncCosts:
    """The costs of a sync besides its links': software, copies and the park. Seconds, bytes/s.

    The defaults are zero cost (infinitely fast copies): the links alone.
    """

    collective_s: float = 0.0
    """Software cost of one control collective on the critical path (launch, wait, the host
    reading a vote), beyond its link time."""
    bucket_s: float = 0.0
    """The source's cost of launching one bucket (overlapped with the link while the link is
    the bottleneck)."""
    forward_s: float = 0.0
    """A relay's hand-off of one bucket: from its arrival to the launch of its forward."""
    manifest_s_per_tensor: float = 0.0
    """A receiver's validation of the manifest (decode, ``check_weights_match``), per tensor."""
    copy_bytes_per_s: float = math.inf
    """Packing a bucket on a source, unpacking it on a receiver (staging copies)."""
    checksum_bytes_per_s: float = math.inf
    """Computing a bucket's checksum (the source) and verifying it (each receiver)."""
    install_s: float = 0.0
    """Fixed cost of one install of staged weights (checking the names, shapes, dtypes)."""
    install_bytes_per_s: float = math.inf
    """Copying staged weights into the served ones, per GPU."""
    park_s: float = 0.0
    """Parking generation: one decode step."""

    def __post_init__(self) -> None:
        for name in ("copy_bytes_per_s", "checksum_bytes_per_s", "install_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SyncCosts.{name} must be > 0, got {getattr(self, name)!r}")
        for name in (
            "collective_s",
            "bucket_s",
            "forward_s",
            "manifest_s_per_tensor",
            "install_s",
            "park_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SyncCosts.{name} must be >= 0 s, got {getattr(self, name)!r}")


class Topology(enum.Enum):
    """How the bytes of a sync travel from the trainer to every replica."""

    ONE_SOURCE = "one_source"
    """P2R from the trainer to the first replica, then R2R from it to the others (today's
    default: ``P2R`` then ``R2R`` commands)."""
    PIPELINED_RELAY = "pipelined_relay"
    """The first replica passes each bucket on as it arrives (``P2R(relay=True)``)."""
    SHARDED_TWO_HOP = "sharded_two_hop"
    """P2R sharded: every trainer rank sends its own regions, point to point, to the replica
    GPUs that serve them, each GPU receiving only its shard
    (:class:`~rollout_sync.transfer.ShardedTransfer`); then R2R GPU ``k`` to GPU ``k`` (a
    broadcast of the first replica's ``k``-th GPU's shard to the others' ``k``-th), after P2R
    is complete: two hops in series (``P2R(relay=True)`` / ``R2R`` over
    :func:`~rollout_sync.sharded_groups.build_sharded_sync_groups`; the sharded relay is not
    pipelined)."""
    SHARDED_PIPELINED = "sharded_pipelined"
    """The first hop of :attr:`SHARDED_TWO_HOP`, with each of the first replica's GPUs passing
    every bucket on as it arrives (the pipelined relay, per GPU:
    ``ShardedTransfer(pipelined_relay=True)``, two-phase)."""
    SHARDED = "sharded_pipelined"
    """The name of :attr:`SHARDED_PIPELINED` from before sharding landed (an alias)."""

    @property
    def implemented(self) -> bool:
        """Whether the package runs this topology today (else the model alone speaks): every
        one does."""
        return True

    @property
    def delta_implemented(self) -> bool:
        """Whether the package moves delta syncs over this topology (docs/delta.md): every one
        but :attr:`SHARDED_PIPELINED`, whose relay passes whole versions on (a delta given to
        it goes whole, saying why)."""
        return self is not Topology.SHARDED_PIPELINED

    @classmethod
    def _missing_(cls, value: object) -> Topology | None:
        """``"sharded"``, the value :attr:`SHARDED` had before sharding landed (in the
        ``topology`` of an older benchmark JSON), reads back as :attr:`SHARDED_PIPELINED`."""
        return cls.SHARDED_PIPELINED if value == "sharded" else None


@dataclass(frozen=True)
class Scenario:
    """One sync to estimate: the model, the fleet's shape, its links, and the options.

    The one-source topologies (one source, the pipelined relay) send the whole model through
    one source's link and each replica GPU receives all of it (a broadcast into the replica's
    group, as the vLLM engine's workers do); the sharded ones send each GPU only its shard.
    """

    model_bytes: int
    bucket_bytes: int
    replicas: int
    nic: Link
    """Every rank's link (one NIC per GPU)."""
    staged: bool = False
    """Receive into a staging area and install after; else write the served tensors in place."""
    tensors: int = 1
    """Named tensors in the model (the manifest validation scales with them)."""
    manifest_bytes: int = 0
    trainer_ranks: int = 1
    gpus_per_replica: int = 1
    checksums: bool = False
    trainer_packs: bool = True
    """The trainer's weights are not flat storage: each bucket is packed (a copy) first."""
    replica_copies: bool = False
    """A replica stages each bucket through a copy: unpacks what it receives, packs what it
    sends (its targets are not flat storage)."""
    gather: Link | None = None
    """One-source topologies with several trainer ranks: how the one source collects each
    bucket from the ranks' shards (``None``: the source holds the weights)."""
    tensors_per_gpu: int | None = None
    """Sharded topologies: the tensors each replica GPU holds, whose manifest and checks it
    pays for (``tensors`` with tensor parallelism: a slice of each). ``None``: ``tensors /
    gpus_per_replica`` (each GPU its own tensors, as expert parallelism places experts)."""
    broadcast: Broadcast = Broadcast.CHAIN
    """How every broadcast of the sync runs (:class:`Broadcast`): NCCL's chain by default;
    ``Broadcast.GLOO`` (or ``"gloo"``) for gloo's binomial tree, where an R2R broadcast to
    ``n`` replicas costs the source ``ceil(log2 n)`` copies."""
    sources_per_gpu: int | None = None
    """Sharded topologies: the trainer ranks whose shards each replica GPU takes regions from
    (all of them when the two sides cut tensors along different dimensions, as FSDP's rows and
    tensor parallelism's columns). A pipelined sharded relay passes a bucket on once its
    tensors have arrived from every one of them, so it forwards in granules of that many
    buckets. ``None``: ``ceil(trainer_ranks / gpus_per_replica)``, the fewest that cover a
    GPU's shard."""
    fanout: int | None = None
    """The sharded two-hop design's R2R as a relay tree
    (``build_sharded_sync_groups(..., fanout=f)``): each replica passes each bucket on to its
    ``f`` children as it arrives, level after level (:func:`tree_depth` levels). ``None``: one
    broadcast from the first replica."""

    def __post_init__(self) -> None:
        if not isinstance(self.broadcast, Broadcast):
            try:
                object.__setattr__(self, "broadcast", Broadcast(self.broadcast))
            except ValueError:
                raise ValueError(
                    f"Scenario.broadcast must be one of {[b.value for b in Broadcast]}, got "
                    f"{self.broadcast!r}"
                ) from None
        for name in ("model_bytes", "bucket_bytes", "replicas", "tensors"):
            if getattr(self, name) < 1:
                raise ValueError(f"Scenario.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("trainer_ranks", "gpus_per_replica"):
            if getattr(self, name) < 1:
                raise ValueError(f"Scenario.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.manifest_bytes < 0:
            raise ValueError(f"Scenario.manifest_bytes must be >= 0, got {self.manifest_bytes}")
        if self.tensors_per_gpu is not None and self.tensors_per_gpu < 1:
            raise ValueError(f"Scenario.tensors_per_gpu must be >= 1, got {self.tensors_per_gpu}")
        if self.sources_per_gpu is not None and self.sources_per_gpu < 1:
            raise ValueError(f"Scenario.sources_per_gpu must be >= 1, got {self.sources_per_gpu}")
        if self.fanout is not None and self.fanout < 1:
            raise ValueError(f"Scenario.fanout must be >= 1 (or None), got {self.fanout}")

    @property
    def gpu_sources(self) -> int:
        """:attr:`sources_per_gpu`, or its default."""
        if self.sources_per_gpu is not None:
            return self.sources_per_gpu
        return min(self.trainer_ranks, math.ceil(self.trainer_ranks / self.gpus_per_replica))

    @property
    def gpu_tensors(self) -> int:
        """The tensors one replica GPU holds (:attr:`tensors_per_gpu`, or its default)."""
        if self.tensors_per_gpu is not None:
            return self.tensors_per_gpu
        return math.ceil(self.tensors / self.gpus_per_replica)

    def per_gpu(self) -> Scenario:
        """This scenario as one replica GPU's shard sees it: ``model_bytes`` its share, its
        tensors and its part of the manifest (in proportion to its tensors)."""
        return replace(
            self,
            model_bytes=math.ceil(self.model_bytes / self.gpus_per_replica),
            tensors=self.gpu_tensors,
            manifest_bytes=math.ceil(self.manifest_bytes * self.gpu_tensors / self.tensors),
        )

    def buckets(self, nbytes: int | None = None) -> list[int]:
        """``nbytes`` (default: the model) cut into buckets of ``bucket_bytes``, the last
        one shorter."""
        total = self.model_bytes if nbytes is None else nbytes
        full, rest = divmod(total, self.bucket_bytes)
        return [self.bucket_bytes] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class Stage:
    """One step every bucket passes, one bucket at a time: a link, a copy, a hand-off."""

    name: str
    rate_bytes_per_s: float = math.inf
    per_bucket_s: float = 0.0
    latency_s: float = 0.0
    """Added to each bucket after it leaves the stage, without occupying it (a link's)."""
    buffers: int | None = None
    """The stage writes into this many buffers in turn: bucket ``k`` waits until stage
    :attr:`freed_by` delivered bucket ``k - buffers``, whose buffer it reuses. ``None``: no
    such limit."""
    freed_by: str | None = None
    """The later stage whose delivery of a bucket frees its buffer (with :attr:`buffers`)."""

    def busy_s(self, nbytes: int) -> float:
        return self.per_bucket_s + nbytes / self.rate_bytes_per_s

    @classmethod
    def link(cls, name: str, link: Link, per_bucket_s: float = 0.0) -> Stage:
        return cls(name, link.rate_bytes_per_s, per_bucket_s, link.latency_s)


@dataclass(frozen=True)
class PipelineRun:
    """What :func:`pipeline` computed: when the last bucket left each stage (latency
    included), and how long each stage was busy in all."""

    stages: tuple[Stage, ...]
    done_s: tuple[float, ...]
    busy_s: tuple[float, ...]

    @property
    def finish_s(self) -> float:
        """When the last bucket left the last stage: the pipeline's time."""
        return self.done_s[-1] if self.done_s else 0.0

    def done_at(self, name: str) -> float:
        return self.done_s[self._index(name)]

    def busy_at(self, name: str) -> float:
        return self.busy_s[self._index(name)]

    def _index(self, name: str) -> int:
        for i, stage in enumerate(self.stages):
            if stage.name == name:
                return i
        raise KeyError(f"no stage {name!r} in {[s.name for s in self.stages]}")


def pipeline(stages: Sequence[Stage], buckets: Sequence[int]) -> PipelineRun:
    """Push ``buckets`` (their sizes in bytes) through ``stages`` in order, each stage one
    bucket at a time, all buckets ready at time 0 (the flow-shop recurrence, rule 1)."""
    stages = tuple(stages)
    names = [stage.name for stage in stages]
    frees = [
        names.index(stage.freed_by) if stage.buffers and stage.freed_by in names else None
        for stage in stages
    ]
    free = [0.0] * len(stages)
    done: list[list[float]] = [[] for _ in stages]
    busy = [0.0] * len(stages)
    for k, nbytes in enumerate(buckets):
        t = 0.0
        for i, stage in enumerate(stages):
            start = max(t, free[i])
            j = frees[i]
            if j is not None and stage.buffers is not None and k >= stage.buffers:
                start = max(start, done[j][k - stage.buffers])
            took = stage.busy_s(nbytes)
            free[i] = start + took
            busy[i] += took
            t = free[i] + stage.latency_s
            done[i].append(t)
    return PipelineRun(stages, tuple(d[-1] if d else 0.0 for d in done), tuple(busy))


@dataclass(frozen=True)
class Phase:
    """A part of a refit's time (:attr:`RefitEstimate.phases` add up to the refit)."""

    name: str
    seconds: float


@dataclass(frozen=True)
class RefitEstimate:
    """What the model says about one sync."""

    topology: Topology
    scenario: Scenario
    refit_s: float
    """From the trainer's push until every replica serves the new version."""
    stall_s: float
    """The longest time a replica's generation stops: in place the park and the whole
    transfer, staged the park and the install."""
    busiest_link_bytes: int
    phases: tuple[Phase, ...]
    """Where the time goes; the seconds add up to :attr:`refit_s`."""

    @property
    def implemented(self) -> bool:
        return self.topology.implemented

    @property
    def design(self) -> str:
        """The topology and the staging, e.g. ``"pipelined_relay, staged"``."""
        return f"{self.topology.value}, {'staged' if self.scenario.staged else 'in place'}"

    def phase_s(self, name: str) -> float:
        """The seconds of the phases called ``name`` (0 if none)."""
        return sum(p.seconds for p in self.phases if p.name == name)

    def __str__(self) -> str:
        parts = ", ".join(f"{p.name} {p.seconds:.3g} s" for p in self.phases if p.seconds > 0)
        mark = "" if self.implemented else " (modelled, not implemented)"
        return (
            f"{self.design}{mark}: refit {self.refit_s:.3g} s, stall {self.stall_s:.3g} s, "
            f"busiest link {self.busiest_link_bytes / 1e9:.3g} GB ({parts})"
        )


def estimate(
    topology: Topology, scenario: Scenario, costs: SyncCosts | None = None
) -> RefitEstimate:
    """The model's refit, stall, busiest link and breakdown for ``topology`` on ``scenario``.

    With one replica every topology is the single P2R hop. The phases are ``control``
    (manifests, validation, votes), ``wire`` (the busiest link's bytes at its rate, per hop in
    series), ``pipeline`` (what the other stages and latencies add: the first bucket's pack,
    the last one's unpack, hand-offs), ``park`` and ``install``.
    """
    costs = costs if costs is not None else SyncCosts()
    s = scenario
    if topology in (Topology.SHARDED_TWO_HOP, Topology.SHARDED_PIPELINED):
        per_gpu = math.ceil(s.model_bytes / s.gpus_per_replica)
        first_link_bytes = max(math.ceil(s.model_bytes / s.trainer_ranks), per_gpu)
        # Each GPU's manifest and checks name its own shard's tensors.
        shard = s.per_gpu()
        if topology is Topology.SHARDED_TWO_HOP:
            phases = _sharded_two_hop(shard, costs, first_link_bytes)
        else:
            phases = _sharded_pipelined(shard, costs, first_link_bytes)
        # The first link's busier side, or the R2R source's copies of its GPU's shard.
        busiest = max(first_link_bytes, s.broadcast.copies(s.replicas) * per_gpu)
    else:
        if topology is Topology.PIPELINED_RELAY:
            phases = _relayed(s, costs, s.model_bytes, s.nic, gather=s.gather)
        else:
            phases = _one_source(s, costs)
        per_gpu = math.ceil(s.model_bytes / s.gpus_per_replica)
        # Through the one source's link, and the R2R source's (the relay's) in its copies.
        busiest = max(1, s.broadcast.copies(s.replicas)) * s.model_bytes
    transfer_s = sum(p.seconds for p in phases)
    park = Phase("park", costs.park_s)
    if s.staged:
        install = Phase("install", costs.install_s + per_gpu / costs.install_bytes_per_s)
        phases = (*phases, park, install)
        stall_s = park.seconds + install.seconds
        refit_s = transfer_s + stall_s
    else:
        phases = (park, *phases)
        refit_s = stall_s = park.seconds + transfer_s
    return RefitEstimate(topology, s, refit_s, stall_s, busiest, phases)


# -- the topologies ---------------------------------------------------------------------------


def _control(link: Link, costs: SyncCosts, nbytes: int = 0) -> float:
    """One control collective in series: latency, its bytes, the software cost."""
    return link.seconds(nbytes) + costs.collective_s


def _manifest(s: Scenario, costs: SyncCosts, link: Link) -> float:
    """Header and manifest broadcasts over ``link`` (the broadcast's, :meth:`Broadcast.link`),
    the receivers' validation: before the vote."""
    return (
        _control(link, costs)
        + _control(link, costs, s.manifest_bytes)
        + costs.manifest_s_per_tensor * s.tensors
    )


def _source_stages(
    s: Scenario, costs: SyncCosts, link: str, *, packs: bool, gather: Link | None
) -> list[Stage]:
    """Before the source's link: the gather or the pack into one of two alternating buffers
    (each freed once ``link`` delivered its bucket), the checksum, the launch."""
    stages = []
    if gather is not None:
        stages.append(
            Stage(
                "gather",
                gather.rate_bytes_per_s,
                latency_s=gather.latency_s,
                buffers=2,
                freed_by=link,
            )
        )
    elif packs:
        stages.append(Stage("pack", costs.copy_bytes_per_s, buffers=2, freed_by=link))
    if s.checksums:
        stages.append(Stage("checksum", costs.checksum_bytes_per_s))
    if costs.bucket_s:
        stages.append(Stage("launch", per_bucket_s=costs.bucket_s))
    return stages


def _receiver_stages(s: Scenario, costs: SyncCosts) -> list[Stage]:
    stages = []
    if s.checksums:
        stages.append(Stage("verify", costs.checksum_bytes_per_s))
    if s.replica_copies:
        stages.append(Stage("unpack", costs.copy_bytes_per_s))
    return stages


def _hop(
    s: Scenario,
    costs: SyncCosts,
    name: str,
    *,
    packs: bool,
    gather: Link | None,
    members: int,
) -> tuple[Phase, ...]:
    """One broadcast hop to a group of ``members`` (the source included), alone: manifest,
    vote, every bucket, commit vote (the votes are all-gathers: one latency each)."""
    link = s.broadcast.link(s.nic, members)
    stages = [
        *_source_stages(s, costs, name, packs=packs, gather=gather),
        Stage.link(name, link),
        *_receiver_stages(s, costs),
    ]
    run = pipeline(stages, s.buckets())
    wire = run.busy_at(name)
    control = _manifest(s, costs, link) + 2 * _control(s.nic, costs)
    return (
        Phase("control", control),
        Phase(f"wire: {name}", wire),
        Phase("pipeline", run.finish_s - wire),
    )


def _one_source(s: Scenario, costs: SyncCosts) -> tuple[Phase, ...]:
    p2r = _hop(s, costs, "P2R link", packs=s.trainer_packs, gather=s.gather, members=2)
    if s.replicas == 1:
        return _merge(p2r)
    r2r = _hop(s, costs, "R2R link", packs=s.replica_copies, gather=None, members=s.replicas)
    return _merge((*p2r, *r2r))


def _relayed(
    s: Scenario,
    costs: SyncCosts,
    nbytes: int,
    first: Link,
    *,
    gather: Link | None,
) -> tuple[Phase, ...]:
    """The pipelined relay over ``nbytes`` per GPU: P2R over ``first`` into the first replica,
    which forwards each bucket to the others' broadcast as it arrives."""
    if s.replicas == 1:
        one = replace(s, model_bytes=nbytes, nic=first)
        return _merge(_hop(one, costs, "P2R link", packs=s.trainer_packs, gather=gather, members=2))
    buckets = s.buckets(nbytes)
    r2r = s.broadcast.link(s.nic, s.replicas)
    # Before the first bucket: the P2R manifest (the relay validates it), the R2R manifest
    # (the others validate it), the R2R vote, then the P2R vote.
    control = _manifest(s, costs, first) + _manifest(s, costs, r2r)
    control += 2 * _control(s.nic, costs)
    stages = [
        *_source_stages(s, costs, "P2R link", packs=s.trainer_packs, gather=gather),
        Stage.link("P2R link", first),
        Stage("hand-off", per_bucket_s=costs.forward_s),
        Stage.link("R2R link", r2r),
        *_receiver_stages(s, costs),
    ]
    run = pipeline(stages, buckets)
    # The relay's own branch: its last bucket verified and unpacked, then the P2R commit vote;
    # the R2R commit vote comes after both that and the others' last bucket.
    relay_tail = sum(st.busy_s(buckets[-1]) for st in _receiver_stages(s, costs))
    relay_done = run.done_at("hand-off") + relay_tail + _control(first, costs)
    end = max(run.finish_s, relay_done)
    control += _control(s.nic, costs)
    return _two_links(run, control, end)


def _two_links(run: PipelineRun, control: float, end: float) -> tuple[Phase, ...]:
    """A relayed sync's phases: its controls, the busier of its two links' wire time, and the
    rest of the pipeline up to ``end``."""
    wire_name, wire = max(
        (("P2R link", run.busy_at("P2R link")), ("R2R link", run.busy_at("R2R link"))),
        key=lambda item: item[1],
    )
    return (
        Phase("control", control),
        Phase(f"wire: {wire_name}", wire),
        Phase("pipeline", end - wire),
    )


def _sharded_two_hop(shard: Scenario, costs: SyncCosts, first_link_bytes: int) -> tuple[Phase, ...]:
    """The implemented sharded sync, from one GPU's ``shard`` (:meth:`Scenario.per_gpu`).

    P2R (:class:`~rollout_sync.transfer.ShardedTransfer`): every rank checks its own tensors
    against its layout, then the plan vote (an all-gather), the buckets, the commit vote. A
    trainer rank packs regions of its tensors and a replica GPU unpacks into its own, whatever
    their storage, so both copies are always paid; the busiest first link carries
    ``first_link_bytes`` at the NIC's rate. Then, after it, R2R: each first-replica GPU's
    shard broadcast to the same GPU of the others, a hop as one source's."""
    p2r_side = replace(shard, model_bytes=first_link_bytes, trainer_packs=True, replica_copies=True)
    stages = [
        *_source_stages(p2r_side, costs, "P2R link", packs=True, gather=None),
        Stage.link("P2R link", shard.nic),
        *_receiver_stages(p2r_side, costs),
    ]
    run = pipeline(stages, p2r_side.buckets())
    wire = run.busy_at("P2R link")
    control = costs.manifest_s_per_tensor * shard.tensors + 2 * _control(shard.nic, costs)
    p2r = (
        Phase("control", control),
        Phase("wire: P2R link", wire),
        Phase("pipeline", run.finish_s - wire),
    )
    if shard.replicas == 1:
        return _merge(p2r)
    if shard.fanout is not None:
        return _merge((*p2r, *_tree(shard, costs, shard.fanout)))
    r2r = _hop(
        shard, costs, "R2R link", packs=shard.replica_copies, gather=None, members=shard.replicas
    )
    return _merge((*p2r, *r2r))


def tree_depth(replicas: int, fanout: int) -> int:
    """The levels of R2R below the first replica in a relay tree of ``fanout`` children per
    replica (a heap: replica ``j``'s parent is ``(j - 1) // fanout``)."""
    depth, reached, level = 0, 1, 1
    while reached < replicas:
        level *= fanout
        reached += level
        depth += 1
    return depth


def _tree(s: Scenario, costs: SyncCosts, fanout: int) -> tuple[Phase, ...]:
    """R2R as a relay tree: every bucket through one broadcast per level (a replica and its
    ``fanout`` children: one copy from the parent on NCCL's chain, ``ceil(log2 (f + 1))`` on
    gloo's tree), each inner replica passing it on as it arrives (a hand-off); each level's
    manifest, validation and manifest vote before the first bucket (a relay passes the manifest
    on before it votes), each level's commit vote after the last."""
    depth = tree_depth(s.replicas, fanout)
    members = min(fanout, s.replicas - 1) + 1
    link = s.broadcast.link(s.nic, members)
    stages = [*_source_stages(s, costs, "R2R link", packs=s.replica_copies, gather=None)]
    for level in range(depth):
        if level:
            stages.append(Stage(f"hand-off {level}", per_bucket_s=costs.forward_s))
        stages.append(Stage.link("R2R link" if not level else f"R2R link {level}", link))
    stages += _receiver_stages(s, costs)
    run = pipeline(stages, s.buckets())
    wire = run.busy_at("R2R link")
    control = depth * (_manifest(s, costs, link) + 2 * _control(s.nic, costs))
    return (
        Phase("control", control),
        Phase("wire: R2R link", wire),
        Phase("pipeline", run.finish_s - wire),
    )


def _sharded_pipelined(
    shard: Scenario, costs: SyncCosts, first_link_bytes: int
) -> tuple[Phase, ...]:
    """The pipelined sharded relay, from one GPU's ``shard``
    (``ShardedTransfer(pipelined_relay=True)``): the sharded P2R's own checks and plan vote,
    the R2R manifest (validated by the others) and its vote, then every bucket through
    [trainer's pack, the first link (its busiest side's ``first_link_bytes`` per GPU's shard,
    so slowed by their ratio), the relay's unpack, its R2R pack, the R2R broadcast, the
    receivers' stages], then, two-phase, in series: the R2R commit vote, the P2R commit vote
    and the relay's verdict. With one replica, the sharded P2R alone."""
    if shard.replicas == 1:
        return _sharded_two_hop(shard, costs, first_link_bytes)
    nbytes = shard.model_bytes
    first = Link(shard.nic.rate_bytes_per_s * nbytes / first_link_bytes, shard.nic.latency_s)
    # The relay forwards a bucket once its tensors arrived from every source of its GPU: in
    # granules of that many buckets.
    granule = replace(shard, bucket_bytes=shard.bucket_bytes * shard.gpu_sources)
    r2r = shard.broadcast.link(shard.nic, shard.replicas)
    control = costs.manifest_s_per_tensor * shard.tensors + _control(shard.nic, costs)
    control += _manifest(shard, costs, r2r) + _control(shard.nic, costs)
    stages = [
        *_source_stages(shard, costs, "P2R link", packs=True, gather=None),
        Stage.link("P2R link", first),
        Stage("unpack at the relay", costs.copy_bytes_per_s),
        Stage("hand-off", per_bucket_s=costs.forward_s),
        *([Stage("pack at the relay", costs.copy_bytes_per_s)] if shard.replica_copies else []),
        Stage.link("R2R link", r2r),
        *_receiver_stages(shard, costs),
    ]
    run = pipeline(stages, granule.buckets(nbytes))
    control += 2 * _control(shard.nic, costs) + _control(r2r, costs)
    return _two_links(run, control, run.finish_s)


def _merge(phases: Sequence[Phase]) -> tuple[Phase, ...]:
    """Phases of one name summed, in first-seen order."""
    totals: dict[str, float] = {}
    for phase in phases:
        totals[phase.name] = totals.get(phase.name, 0.0) + phase.seconds
    return tuple(Phase(name, seconds) for name, seconds in totals.items())


# -- a named fleet ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    """A fleet to extrapolate to: its model, its GPUs, its links, and its costs.

    Every constant says where it comes from in :attr:`sources`; the model's output is only as
    good as they are.
    """

    name: str
    model_bytes: int
    tensors: int
    trainer_gpus: int
    replicas: int
    gpus_per_replica: int
    gpus_per_node: int
    nic: Link
    nvlink: Link
    bucket_bytes: int
    costs: SyncCosts
    device_install_bytes_per_s: float
    """An install from staging in device memory (an HBM copy), where memory allows one."""
    sources: tuple[tuple[str, str], ...] = field(default=())
    """(constant, where it comes from)."""

    @property
    def speed_of_light_s(self) -> float:
        """Each replica must take in the whole model through its GPUs' NICs."""
        return self.model_bytes / (self.gpus_per_replica * self.nic.rate_bytes_per_s)

    def scenario(self, *, staged: bool) -> Scenario:
        """The fleet as a :class:`Scenario`. For the one-source topologies (one source, the
        pipelined relay) the trainer's one sending rank gathers each bucket from all trainer
        GPUs: the node's others over NVLink, the rest through its NIC, overlapped by bucket;
        the sharded ones need no gather."""
        ranks = self.trainer_gpus
        # The sending rank's share of each bucket that crosses its NIC (the other nodes') and
        # its NVLink (its own node's others); a path that carries nothing bounds nothing.
        remote = max(0, ranks - self.gpus_per_node) / ranks
        local = (min(ranks, self.gpus_per_node) - 1) / ranks
        gather_rate = min(
            self.nic.rate_bytes_per_s / remote if remote else math.inf,
            self.nvlink.rate_bytes_per_s / local if local else math.inf,
        )
        return Scenario(
            model_bytes=self.model_bytes,
            bucket_bytes=self.bucket_bytes,
            replicas=self.replicas,
            nic=self.nic,
            staged=staged,
            tensors=self.tensors,
            manifest_bytes=self.tensors * 96,
            trainer_ranks=self.trainer_gpus,
            gpus_per_replica=self.gpus_per_replica,
            trainer_packs=False,
            replica_copies=False,
            gather=Link(gather_rate, self.nic.latency_s) if self.trainer_gpus > 1 else None,
        )

    def estimates(self) -> list[RefitEstimate]:
        """Every topology, staged and in place."""
        return [
            estimate(topology, self.scenario(staged=staged), self.costs)
            for topology in Topology
            for staged in (False, True)
        ]


FLEET_1T = Fleet(
    name="1T parameters (Kimi-K2 class), bf16: 256 trainer GPUs -> 4 replicas x 32 GPUs",
    model_bytes=2 * 10**12,
    tensors=70_000,
    trainer_gpus=256,
    replicas=4,
    gpus_per_replica=32,
    gpus_per_node=8,
    nic=Link(50e9, 20e-6),
    nvlink=Link(450e9, 5e-6),
    bucket_bytes=32 << 20,
    costs=SyncCosts(
        collective_s=200e-6,
        bucket_s=20e-6,
        forward_s=50e-6,
        manifest_s_per_tensor=1e-6,
        copy_bytes_per_s=1.5e12,
        checksum_bytes_per_s=500e9,
        install_s=0.05,
        install_bytes_per_s=40e9,
        park_s=0.05,
    ),
    device_install_bytes_per_s=1.5e12,
    sources=(
        ("model_bytes", "1T parameters x 2 bytes (bf16): 2 TB (the issue; vLLM's RDT post)"),
        ("trainer_gpus, replicas, gpus_per_replica", "vLLM's sharded_rdt run: 256 -> 4 x 32"),
        ("nic", "one 400 Gb/s NIC (50 GB/s) per GPU; 20 us latency (RDMA + NCCL launch)"),
        ("nvlink", "H100 NVLink 900 GB/s both ways: 450 GB/s each way, within a node of 8"),
        ("tensors", "assumed ~70,000 named tensors (61 layers, 384 experts x 3 in 60)"),
        ("manifest_s_per_tensor", "0.3-0.5 us measured here (benchmarks/scale.py); 1 us assumed"),
        ("copy_bytes_per_s", "an HBM-to-HBM copy on an H100: ~1.5 TB/s (assumed)"),
        ("install_bytes_per_s", "host staging, PCIe Gen5 x16 to the GPU: 40 GB/s (assumed)"),
        ("device_install_bytes_per_s", "device staging: an HBM copy, 1.5 TB/s (assumed)"),
        ("park_s", "one decode step of a 1T MoE replica: 50 ms (assumed)"),
        ("collective_s, bucket_s, forward_s", "NCCL launch and host reads (assumed)"),
        (
            "gpus_per_node",
            "8 H100 on one NVLink switch (HGX H100), as vLLM's run: 32 x 8 -> 16 x 8",
        ),
        (
            "bucket_bytes",
            "32 MiB (assumed, no published run's size): its wire time at 50 GB/s, 0.67 ms, "
            "dwarfs a bucket's 20 us latency and 20 us launch; two buffers cost 64 MiB per GPU",
        ),
        (
            "install_s",
            "50 ms (assumed): the fixed part of an install (names, shapes, dtypes checked, a "
            "copy launched per tensor) took 7 ms for 2,188 tensors on this repo's 2-core CPU "
            "(IdleFlatRollout.load_weights, nothing to copy); rounded up for a GPU's launches",
        ),
        (
            "checksum_bytes_per_s",
            "500 GB/s (assumed): bucket_checksum's few passes of 64-bit sums over HBM (3.35 TB/s "
            "on an H100 SXM); unused in the fleet's scenarios, which run without checksums",
        ),
    ),
)
"""The fleet vLLM's sharded engine published on, so the numbers compare (docs/scale.md)."""
