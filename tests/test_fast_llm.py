"""The Fast-LLM receiver against a real redis-server and a trainer written from the protocol.

The trainer side is :class:`rollout_sync.testing.fast_llm_trainer.FastLLMTrainerStandIn` (it
imports nothing of the receiver); Redis is the system's ``redis-server``, started on a free port
for this module. Every test ends with the receiver's served weights either exactly the
trainer's or exactly what they were before.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ThreadRunner

pytest.importorskip("redis")

from rollout_sync.backend import RolloutBase  # noqa: E402
from rollout_sync.backends.torch_lm import (  # noqa: E402
    TinyCausalLM,
    TinyLMConfig,
    TorchLMBackend,
    TorchLMStreamBackend,  # noqa: E402
)
from rollout_sync.distributed import standalone_group  # noqa: E402
from rollout_sync.errors import (  # noqa: E402
    CollectiveError,
    FastLLMProtocolError,
    ManifestRejected,
    PayloadTimeout,
    RolloutSyncError,
    TornWeightsError,
    TwoCommunicatorsRefused,
    UnsafeHeaderError,
    WeightMismatchError,
    WeightTransferError,
    WouldBlock,
)
from rollout_sync.gate import Gate  # noqa: E402
from rollout_sync.integrations.fast_llm import (  # noqa: E402
    FastLLMReceiver,
    FastLLMRolloutSender,
    ReceivedVersion,
)
from rollout_sync.integrations.fast_llm_wire import (  # noqa: E402
    ROLLOUTS_STREAM,
    HeaderUnpickler,
    TrainingFinished,
    WeightsReady,
    decode_header,
    decode_rollout,
    parse_event,
)
from rollout_sync.sync import SyncMode  # noqa: E402
from rollout_sync.testing import (  # noqa: E402
    FaultSchedule,
    Kill,
    fault_point,
    find_free_port,
    run_processes,
    weights_digest,
)
from rollout_sync.testing.fast_llm_trainer import FastLLMTrainerStandIn  # noqa: E402
from rollout_sync.testing.redis_server import RedisServer, require_redis_server  # noqa: E402
from rollout_sync.trace import SpanKind, Timeline, find_overlaps  # noqa: E402
from rollout_sync.transfer import TransferConfig, WeightTransfer  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis]

CONFIG = TinyLMConfig()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    try:
        require_redis_server()
    except ImportError as exc:
        pytest.skip(str(exc))
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis(redis_server: RedisServer) -> Any:
    client = redis_server.client()
    client.flushall()
    return client


def trainer_weights(seed: int) -> dict[str, torch.Tensor]:
    model = TinyCausalLM.build(CONFIG, seed=seed)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def connected(
    redis: Any, rollout: Any, runner: ThreadRunner, **receiver_kwargs: Any
) -> tuple[FastLLMTrainerStandIn, FastLLMReceiver]:
    """A trainer and a receiver in one group (each blocks in the rendezvous until both are)."""
    port = find_free_port()
    trainer = FastLLMTrainerStandIn(redis, host="127.0.0.1", port=port, timeout_s=30)
    receiver = FastLLMReceiver(
        rollout, redis=redis, group_address=("127.0.0.1", port), timeout_s=30, **receiver_kwargs
    )
    runner.start(trainer.connect, name="trainer-connect")
    receiver.connect()
    joined(runner)
    return trainer, receiver


def joined(runner: ThreadRunner, timeout: float = 60.0) -> None:
    """Join every thread the runner started; re-raise the first error one of them had."""
    errors = runner.join_all(timeout)
    if errors:
        raise errors[0]


def served_digest(rollout: Any) -> str:
    return weights_digest(rollout.served_weights())


class PlainEngine(RolloutBase):
    """A user's engine: ``paused()`` parks its generation, and nothing in it looks at
    ``weights_torn`` (the package's own backends do; this one relies on the receiver)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = trainer_weights(0)
        self.generation = Gate.for_generation("forward", timeout=30)

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        return self.weights

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[None]:
        with self.generation.exclusive(timeout):
            yield None

    def can_generate(self) -> bool:
        """Whether a forward could start now (without waiting for one)."""
        try:
            self.generation.enter_section_nowait()
        except WouldBlock:
            return False
        self.generation.exit_section()
        return True


# -- the wire ----------------------------------------------------------------------------------


def test_headers_admit_the_protocols_types_only(tmp_path: Path) -> None:
    header = pickle.dumps(("weights", "layers.0.w", torch.Size([3, 4]), torch.bfloat16))
    decoded = decode_header(header)
    assert decoded is not None
    assert (decoded.shard, decoded.name, decoded.shape, decoded.dtype) == (
        "weights",
        "layers.0.w",
        (3, 4),
        torch.bfloat16,
    )
    assert decode_header(b"\x80\x04N.") is None  # the end marker, byte for byte
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    with pytest.raises(UnsafeHeaderError, match=r"posix.system|os.system"):
        decode_header(pickle.dumps(("weights", "w", torch.Size([1]), Evil())))
    assert not marker.exists()
    with pytest.raises(UnsafeHeaderError):
        HeaderUnpickler(__import__("io").BytesIO(pickle.dumps(torch.nn.Linear))).load()
    with pytest.raises(UnsafeHeaderError, match=r"\(shard, name, shape, dtype\)"):
        decode_header(pickle.dumps(["weights", "w"]))
    with pytest.raises(UnsafeHeaderError, match="does not unpickle"):
        decode_header(b"\x80\x04garbage")


def test_events_parse_as_fast_llm_writes_them() -> None:
    ready = parse_event({b"event": b'{"type": "weights_ready", "step": 3, "documents_seen": 96}'})
    assert ready == WeightsReady(3, 96) and ready.version == 96
    assert parse_event({"event": '{"type": "weights_ready", "step": 3}'}).version == 3  # type: ignore[union-attr]
    assert parse_event({b"event": b'{"type": "training_finished"}'}) == TrainingFinished()
    with pytest.raises(FastLLMProtocolError, match="unknown"):
        parse_event({b"event": b'{"type": "bogus"}'})
    with pytest.raises(FastLLMProtocolError):
        parse_event({b"other": b"1"})


# -- full streams ------------------------------------------------------------------------------


def test_streams_land_bit_identically_and_training_finished_tears_down(redis: Any) -> None:
    runner = ThreadRunner()
    rollout = TorchLMBackend(CONFIG)
    landed: list[ReceivedVersion] = []
    # history=1: the receiver keeps only the latest version and report, and counts them all.
    trainer, receiver = connected(
        redis, rollout, runner, history=1, on_version=lambda v, _: landed.append(v)
    )
    first, second = trainer_weights(1), trainer_weights(2)
    optimizer_state = [
        ("exp_avgs", f"{n}/exp_avgs", torch.zeros_like(t)) for n, t in second.items()
    ]

    def train() -> None:
        trainer.push(1, 32, first)
        trainer.push(2, 64, [("weights", n, t) for n, t in second.items()] + optimizer_state)
        trainer.training_finished()

    runner.start(train, name="trainer")
    versions = receiver.serve(idle_timeout_s=60)
    joined(runner)
    assert [(v.version, v.step, v.tensors) for v in landed] == [
        (32, 1, len(first)),
        (64, 2, len(second)),
    ]
    assert landed[1].dropped == len(optimizer_state) and landed[0].dropped == 0
    assert versions == landed[-1:] and receiver.versions_received == 2
    assert served_digest(rollout) == weights_digest(second)
    assert rollout.weight_version == 64 and not rollout.weights_torn
    assert receiver.finished and receiver.group is None
    assert len(receiver.sync_reports) == 1 and receiver.sync_reports[0].error is None
    trainer.close()


def test_events_of_an_earlier_run_are_not_replayed(redis: Any) -> None:
    """The stream is never trimmed: a receiver starts after what was there when it connected."""
    redis.xadd(
        "fast_llm_events", {"event": '{"type": "weights_ready", "step": 9, "documents_seen": 9}'}
    )
    redis.xadd("fast_llm_events", {"event": '{"type": "training_finished"}'})
    runner = ThreadRunner()
    rollout = TorchLMBackend(CONFIG)
    trainer, receiver = connected(redis, rollout, runner)
    weights = trainer_weights(3)

    def train() -> None:
        trainer.push(1, 5, weights)
        trainer.training_finished()

    runner.start(train, name="trainer")
    assert [v.version for v in receiver.serve(idle_timeout_s=60)] == [5]
    joined(runner)
    assert served_digest(rollout) == weights_digest(weights)
    trainer.close()


# -- bad streams: a clear error, the served weights untouched ----------------------------------


def _untouched_after(
    redis: Any, send: Any, error: type[BaseException], match: str, **receiver_kwargs: Any
) -> Any:
    runner = ThreadRunner()
    rollout = TorchLMBackend(CONFIG)
    rollout.ensure_initialized()
    before = served_digest(rollout)
    trainer, receiver = connected(redis, rollout, runner, **receiver_kwargs)
    runner.start(lambda: send(trainer), name="trainer")
    event = receiver.next_event(30)
    assert isinstance(event, WeightsReady)
    with pytest.raises(error, match=match) as raised:
        receiver.take(event)
    assert served_digest(rollout) == before
    assert rollout.weight_version == 0 and not rollout.weights_torn
    return trainer, receiver, rollout, runner, raised.value


@pytest.mark.parametrize("mode", [SyncMode.SYNC, SyncMode.STAGED])
def test_a_malicious_header_is_refused_before_it_runs(
    redis: Any, tmp_path: Path, mode: SyncMode
) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    def send(trainer: FastLLMTrainerStandIn) -> None:
        trainer.weights_ready(1, 8)
        trainer.broadcast_raw(pickle.dumps(Evil()))

    trainer, receiver, _, runner, _ = _untouched_after(
        redis, send, UnsafeHeaderError, "system", mode=mode
    )
    joined(runner)
    assert not marker.exists()
    assert receiver.group is None  # out of step with the trainer: abandoned
    if mode is SyncMode.STAGED:  # refused before any install: generation never parked
        assert receiver.sync_reports[-1].stall_s == 0.0 and not receiver.sync_reports[-1].paused
    trainer.close()


@pytest.mark.parametrize(
    ("send_header", "match", "receiver_kwargs"),
    [
        # A length past max_header_bytes is refused before anything is allocated or read.
        (lambda t: t.broadcast_length(1 << 20), "a header of 1048576 bytes", {}),
        (lambda t: t.broadcast_length(0), "a header of 0 bytes", {}),
        # A tensor announced at more than 8x the largest served one is never allocated.
        (
            lambda t: t.broadcast_raw(
                pickle.dumps(("weights", "w", torch.Size([1 << 20, 1 << 10]), torch.float32))
            ),
            "more than 8x any served tensor",
            {},
        ),
        # A real header, longer than this receiver accepts.
        (
            lambda t: t.broadcast_length(
                len(pickle.dumps(("weights", "w", torch.Size([4]), torch.float32)))
            ),
            "the receiver accepts 1 .. 16",
            {"max_header_bytes": 16},
        ),
    ],
)
def test_a_header_the_receiver_cannot_afford_is_refused_before_allocating(
    redis: Any, send_header: Any, match: str, receiver_kwargs: dict[str, Any]
) -> None:
    def send(trainer: FastLLMTrainerStandIn) -> None:
        trainer.weights_ready(1, 8)
        send_header(trainer)

    trainer, receiver, _, runner, _ = _untouched_after(
        redis, send, UnsafeHeaderError, match, **receiver_kwargs
    )
    joined(runner)
    assert receiver.group is None  # out of step with the trainer: abandoned
    trainer.close()


@pytest.mark.parametrize(
    ("damage", "mode"),
    [(d, SyncMode.SYNC) for d in ("shape", "dtype", "unknown name", "missing", "twice")]
    + [("shape", SyncMode.STAGED), ("missing", SyncMode.STAGED)],
)
def test_a_stream_that_does_not_match_is_refused_whole_and_the_next_lands(
    redis: Any, damage: str, mode: SyncMode
) -> None:
    weights = trainer_weights(4)
    names = list(weights)
    bad: list[tuple[str, str, torch.Tensor]] = [("weights", n, t) for n, t in weights.items()]
    if damage == "shape":
        bad[1] = ("weights", names[1], torch.zeros(3, 5))
    elif damage == "dtype":
        bad[1] = ("weights", names[1], weights[names[1]].to(torch.float64))
    elif damage == "unknown name":
        bad[1] = ("weights", "model.bogus.weight", weights[names[1]])
    elif damage == "twice":
        bad.append(bad[0])
    else:
        del bad[1]

    def send(trainer: FastLLMTrainerStandIn) -> None:
        trainer.push(1, 8, bad)
        trainer.push(2, 16, weights)  # the receiver stayed in step: this one lands

    trainer, receiver, rollout, runner, error = _untouched_after(
        redis, send, WeightMismatchError, "nothing written", mode=mode
    )
    if damage in ("shape", "dtype"):  # it came, refused: named once, never as missing
        assert str(error).count(names[1]) == 1 and "did not come" not in str(error)
    event = receiver.next_event(30)
    assert isinstance(event, WeightsReady)
    receiver.take(event)
    joined(runner)
    assert served_digest(rollout) == weights_digest(weights) and rollout.weight_version == 16
    trainer.close()
    receiver.close()


def test_a_tensor_shorter_than_its_header_is_refused_whole(redis: Any) -> None:
    """gloo completes a receive whose sender sent fewer bytes than the buffer holds, writing
    its front only: the receiver still refuses the version whole, naming the tensor and the
    byte counts, and stays in step (the next version lands). Three receivers, since gloo's
    broadcast is a tree: rank 3 gets rank 1's whole buffer, not the trainer's short tensor.
    Rank 2 receives in place into an engine that never looks at ``weights_torn``: torn, and
    parked until the next version lands."""
    weights = trainer_weights(7)
    name, full = next((n, t) for n, t in weights.items() if t.dim() == 2)
    short = full[:-1].clone()  # one row short, under the whole tensor's header
    problem = f"{name}: {short.nbytes} of the {full.nbytes} bytes its header announces arrived"
    port = find_free_port()
    trainer = FastLLMTrainerStandIn(redis, host="127.0.0.1", port=port, world_size=4, timeout_s=30)
    rollouts: dict[int, Any] = {
        1: TorchLMBackend(CONFIG),
        2: PlainEngine(),
        3: TorchLMBackend(CONFIG),
    }
    receivers = {
        rank: FastLLMReceiver(
            rollout,
            redis=redis,
            group_address=("127.0.0.1", port),
            rank=rank,
            world_size=4,
            timeout_s=30,
            stage=rank != 2,
        )
        for rank, rollout in rollouts.items()
    }
    before = {rank: served_digest(rollout) for rank, rollout in rollouts.items()}
    runner = ThreadRunner()
    runner.start(trainer.connect, name="trainer-connect")
    for rank in (1, 2):
        runner.start(receivers[rank].connect, name=f"receiver-{rank}-connect")
    receivers[3].connect()
    joined(runner)

    def train() -> None:
        trainer.weights_ready(1, 8)
        for n, t in weights.items():
            header = pickle.dumps(("weights", n, t.shape, t.dtype))
            trainer.broadcast_raw(header, short if n == name else t)
        trainer.broadcast_raw(pickle.dumps(None))
        trainer.push(2, 16, weights)

    # What each rank saw after the refusal; checked once every rank took the next version
    # (a rank that stopped early would leave the others waiting in the broadcast).
    refusals: dict[int, tuple[Exception | None, bool, bool, bool]] = {}

    def receive(rank: int) -> None:
        receiver, rollout = receivers[rank], rollouts[rank]
        refused = receiver.next_event(30)
        assert isinstance(refused, WeightsReady)
        error: Exception | None = None
        try:
            receiver.take(refused)
        except Exception as exc:  # noqa: BLE001 - checked below
            error = exc
        untouched = served_digest(rollout) == before[rank] and rollout.weight_version == 0
        parked = isinstance(rollout, PlainEngine) and not rollout.can_generate()
        refusals[rank] = (error, untouched, rollout.weights_torn, parked)
        landed = receiver.next_event(30)
        assert isinstance(landed, WeightsReady)
        receiver.take(landed)

    runner.start(train, name="trainer")
    for rank in (1, 2):
        runner.start(functools.partial(receive, rank), name=f"receiver-{rank}")
    receive(3)
    joined(runner)
    for rank in (1, 3):  # staged: refused whole, nothing written
        error, untouched, torn, _ = refusals[rank]
        assert isinstance(error, WeightMismatchError) and "nothing written" in str(error)
        assert [p[: len(problem)] for p in error.problems] == [problem]
        assert untouched and not torn
    error, _, torn, parked = refusals[2]  # in place: torn, and parked by the receiver
    assert isinstance(error, WeightTransferError) and "see the cause" in str(error)
    cause = error.__cause__  # the refusal itself, with its problems
    assert isinstance(cause, WeightMismatchError) and problem in str(cause)
    assert [p[: len(problem)] for p in cause.problems] == [problem]
    assert error.tensors_written == len(weights) and torn and parked
    for rollout in rollouts.values():
        assert served_digest(rollout) == weights_digest(weights) and rollout.weight_version == 16
    assert not rollouts[2].weights_torn and rollouts[2].can_generate()
    trainer.close()
    for receiver in receivers.values():
        receiver.close()


@pytest.mark.parametrize("mode", [SyncMode.SYNC, SyncMode.STAGED])
def test_a_version_the_group_replica_refuses_is_aborted_for_its_r2r_receivers(
    redis: Any, mode: SyncMode
) -> None:
    """Fan-out: replica 1 refuses a version (a wrong shape), so its R2R receiver is told at
    once that none is coming (ManifestRejected, not a timeout, nothing written); the next
    version reaches both. Staged, the R2R receiver stages into its StagingArea: the refused
    version is discarded there, the next installed from it."""
    runner = ThreadRunner()
    first, second = TorchLMBackend(CONFIG), TorchLMBackend(CONFIG)
    second.ensure_initialized()
    before = served_digest(second)
    port = find_free_port()
    groups: dict[int, Any] = {}

    def join(rank: int) -> None:
        groups[rank] = standalone_group("127.0.0.1", port, rank, 2, timeout_s=30)

    runner.start(lambda: join(0), name="r2r-source-join")
    join(1)
    joined(runner)
    config = TransferConfig(timeout_s=30)
    downstream = FastLLMReceiver(
        second,
        redis=redis,
        r2r=WeightTransfer(groups[1], 0, config=config),
        timeout_s=30,
        mode=mode,
    )
    downstream.connect()
    trainer, upstream = connected(
        redis, first, runner, r2r=WeightTransfer(groups[0], 0, config=config), mode=mode
    )
    good = trainer_weights(6)
    bad = dict(good)
    bad[next(iter(bad))] = torch.zeros(3, 5)

    def train() -> None:
        trainer.push(1, 8, bad)
        trainer.push(2, 16, good)

    def replica_one() -> None:
        refused = upstream.next_event(30)
        assert isinstance(refused, WeightsReady)
        with pytest.raises(WeightMismatchError):
            upstream.take(refused)
        landed = upstream.next_event(30)
        assert isinstance(landed, WeightsReady)
        upstream.take(landed)

    runner.start(train, name="trainer")
    runner.start(replica_one, name="replica-1")
    event = downstream.next_event(30)
    assert isinstance(event, WeightsReady)
    with pytest.raises(ManifestRejected, match="aborted the transfer of version 8"):
        downstream.take(event)
    assert served_digest(second) == before and not second.weights_torn
    event = downstream.next_event(30)
    assert isinstance(event, WeightsReady)
    downstream.take(event)
    joined(runner)
    assert served_digest(first) == served_digest(second) == weights_digest(good)
    assert first.weight_version == second.weight_version == 16
    if mode is SyncMode.STAGED:
        assert downstream.staging is not None
        # The aborted version never reached its staging copy (made when a whole version's
        # manifest arrives): nothing to discard.
        assert (downstream.staging.installs, downstream.staging.discarded) == (1, 0)
        landed = downstream.sync_reports[-1]  # parked for the install only
        assert landed.error is None and 0 < landed.stall_s < landed.total_s
    else:
        assert downstream.staging is None
    trainer.close()
    upstream.close()


def _dies_mid_stream(
    rank: int, redis_url: str, port: int, weights: dict[str, torch.Tensor]
) -> None:
    import redis as redis_client

    trainer = FastLLMTrainerStandIn(
        redis_client.Redis.from_url(redis_url), host="127.0.0.1", port=port, timeout_s=30
    )
    trainer.connect()
    trainer.weights_ready(1, 8)
    for name, tensor in list(weights.items())[:3]:
        trainer.broadcast_raw(pickle.dumps(("weights", name, tensor.shape, tensor.dtype)), tensor)
    fault_point("mid_stream")  # killed: no end marker, its connections close


@pytest.mark.parametrize(
    ("stage", "mode"),
    [(True, SyncMode.SYNC), (False, SyncMode.SYNC), (True, SyncMode.STAGED)],
)
def test_a_trainer_killed_mid_stream(
    redis: Any, redis_server: RedisServer, stage: bool, mode: SyncMode
) -> None:
    """Staged buffers: a clear error, the weights untouched (``SyncMode.STAGED``: and
    generation never parked). In place: the error names the in-place writes, the weights are
    marked torn, and generation stays parked although the engine never looks at
    ``weights_torn`` (the receiver holds its pause), until ``stop_engine``."""
    rollout = PlainEngine()
    before = served_digest(rollout)
    port = find_free_port()
    runner = ThreadRunner()
    runner.start(
        lambda: run_processes(
            _dies_mid_stream,
            1,
            (redis_server.url, port, trainer_weights(5)),
            timeout_s=60,
            faults=FaultSchedule(Kill(0, "mid_stream")),
        ),
        name="trainer-process",
    )
    receiver = FastLLMReceiver(
        rollout,
        redis=redis,
        group_address=("127.0.0.1", port),
        timeout_s=30,
        stage=stage,
        mode=mode,
    )
    receiver.connect()
    event = receiver.next_event(30)
    assert isinstance(event, WeightsReady)
    with pytest.raises((CollectiveError, WeightTransferError)) as raised:
        receiver.take(event)
    joined(runner)
    assert receiver.group is None
    # gloo's words for a peer that died; which one depends on timing (docs/fast_llm.md).
    broken = "Connection (reset|closed) by peer"
    if stage:
        assert isinstance(raised.value, CollectiveError)
        assert re.search(broken, str(raised.value))
        assert served_digest(rollout) == before and not rollout.weights_torn
        assert rollout.can_generate()
        report = receiver.sync_reports[-1]
        assert report.error is not None and "CollectiveError" in report.error
        assert report.paused is (mode is SyncMode.SYNC)
        assert (report.stall_s == 0.0) is (mode is SyncMode.STAGED)
    else:
        assert isinstance(raised.value, WeightTransferError)
        assert isinstance(raised.value.__cause__, CollectiveError)
        assert re.search(broken, str(raised.value)) and raised.value.tensors_written == 3
        assert rollout.weights_torn
        with pytest.raises(TornWeightsError, match="written before the transfer failed"):
            rollout.check_servable()
        assert not rollout.can_generate()  # parked though the engine never checks
        elsewhere = ThreadRunner()  # the pause is this thread's: another cannot release it
        elsewhere.start(receiver.stop_engine, name="other-thread-stop")
        elsewhere.start(lambda: receiver.take(event), name="other-thread-take")
        elsewhere.start(receiver.serve, name="other-thread-serve")
        assert [type(e) for e in elsewhere.join_all(30)] == [RolloutSyncError] * 3
        assert not rollout.can_generate()
        receiver.stop_engine()  # the end of serving lets it go
        assert rollout.can_generate()
    assert rollout.weight_version == 0


def test_a_redis_restart_is_a_clear_error(redis: Any, redis_server: RedisServer) -> None:
    runner = ThreadRunner()
    rollout = TorchLMBackend(CONFIG)
    rollout.ensure_initialized()
    before = served_digest(rollout)
    trainer, receiver = connected(redis, rollout, runner)
    redis_server.restart()
    with pytest.raises(FastLLMProtocolError, match="restarted"):
        receiver.serve(idle_timeout_s=30, poll_s=0.2)
    assert served_digest(rollout) == before and rollout.weight_version == 0
    trainer.close()
    receiver.close()


def test_a_redis_client_without_a_socket_timeout_is_refused(
    redis: Any, redis_server: RedisServer
) -> None:
    import redis as redis_client

    unbounded = redis_client.Redis(host="127.0.0.1", port=redis_server.port)
    with pytest.raises(ValueError, match="socket_timeout"):
        FastLLMReceiver(TorchLMBackend(CONFIG), redis=unbounded)
    with pytest.raises(ValueError, match=r"history=-1"):
        FastLLMReceiver(TorchLMBackend(CONFIG), redis=redis, history=-1)


# -- the pause covers the whole receive --------------------------------------------------------


@pytest.mark.parametrize("guarded", [True, False])
def test_the_pause_covers_the_whole_receive(redis: Any, guarded: bool) -> None:
    """Generation streams throughout; the first version arrives before it starts (and starts
    it). Guarded: no forward overlaps a write. Unguarded, the same harness finds overlaps."""
    timeline = Timeline()
    rollout = TorchLMStreamBackend(CONFIG, max_concurrent=4, timeline=timeline)
    runner = ThreadRunner()
    trainer, receiver = connected(
        redis, rollout, runner, timeline=timeline, stage=False, guarded=guarded
    )
    pushed = threading.Event()
    steps = 12

    def train() -> None:
        for step in range(1, steps + 1):
            trainer.push(step, step * 8, trainer_weights(10 + step))
            if step == 1:
                pushed.set()
        trainer.training_finished()

    def feed() -> None:
        pushed.wait(30)
        while not receiver.finished:
            for _ in range(4):
                rollout.put([1, 2, 3], max_new_tokens=24)
            rollout.scheduler.get(timeout=30)

    runner.start(train, name="trainer")
    runner.start(feed, name="feeder")
    try:
        versions = receiver.serve(idle_timeout_s=60)
    finally:
        joined(runner)
        receiver.stop_engine(30)
    assert len(versions) == steps and rollout.weight_version == steps * 8
    spans = timeline.spans()
    forwards = [s for s in spans if s.kind == SpanKind.FORWARD]
    writes = [s for s in spans if s.kind == SpanKind.WEIGHT_WRITE]
    assert len(forwards) > 20 and len(writes) >= steps * len(trainer_weights(0))
    overlaps = find_overlaps(spans, [(SpanKind.FORWARD, SpanKind.WEIGHT_WRITE)])
    if guarded:
        assert overlaps == []
    else:
        assert overlaps, "without the bracket, forwards ran inside the in-place receive"
    trainer.close()


# -- staged: generation goes on during the wire ------------------------------------------------


class HoldSignal:
    """A payload sender with ``hold_sends`` only: says when a sync starts holding it (the
    bracket holds egress right before its body) and whether it is held now."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.holding = 0

    @contextmanager
    def hold_sends(self, timeout: float | None = None) -> Iterator[None]:
        self.holding += 1
        self.entered.set()
        try:
            yield
        finally:
            self.holding -= 1


@pytest.mark.parametrize("mode", [SyncMode.STAGED, SyncMode.SYNC])
def test_a_staged_receive_parks_generation_for_the_install_only(redis: Any, mode: SyncMode) -> None:
    """The trainer stops half-way through a stream until the engine has run three forwards.
    Staged, they run while the receiver waits on the wire (payload egress held all along), the
    weights are written only under the install's stall, which is a sliver of the sync, and the
    torn-read detector counts nothing. The counterfactual, the default mode: the receive is
    parked whole, so no forward runs on the wire (the trainer's wait runs out)."""
    timeline = Timeline()
    rollout = TorchLMStreamBackend(CONFIG, max_concurrent=4, timeline=timeline)
    packer = HoldSignal()
    runner = ThreadRunner()
    trainer, receiver = connected(
        redis, rollout, runner, timeline=timeline, mode=mode, data_packer=packer
    )
    first, second = trainer_weights(21), trainer_weights(22)
    runner.start(lambda: trainer.push(1, 8, first), name="trainer-first")
    initial = receiver.next_event(30)
    assert isinstance(initial, WeightsReady)
    receiver.take(initial)  # before generation: it starts the engine
    joined(runner)

    in_wire, enough = threading.Event(), threading.Event()
    forwards_in_wire = 0

    def count_forwards(layer: int) -> None:
        nonlocal forwards_in_wire
        if layer == 0 and in_wire.is_set():
            forwards_in_wire += 1
            if forwards_in_wire >= 3:
                enough.set()

    rollout.layer_hook = count_forwards
    done = threading.Event()

    def feed() -> None:
        while not done.is_set():
            for _ in range(4):
                rollout.put([1, 2, 3], max_new_tokens=24)
            rollout.scheduler.get(timeout=30)

    seen: dict[str, bool] = {}

    def train() -> None:
        packer.entered.clear()
        trainer.weights_ready(2, 16)
        assert packer.entered.wait(30)  # the receiver's sync has begun
        items = list(second.items())
        for name, tensor in items[:2]:
            trainer.broadcast_raw(
                pickle.dumps(("weights", name, tensor.shape, tensor.dtype)), tensor
            )
        in_wire.set()
        seen["forwards went on"] = enough.wait(30 if mode is SyncMode.STAGED else 0.5)
        seen["egress held"] = packer.holding > 0
        in_wire.clear()
        for name, tensor in items[2:]:
            trainer.broadcast_raw(
                pickle.dumps(("weights", name, tensor.shape, tensor.dtype)), tensor
            )
        trainer.broadcast_raw(pickle.dumps(None))

    runner.start(feed, name="feeder")
    runner.start(train, name="trainer")
    event = receiver.next_event(30)
    assert isinstance(event, WeightsReady)
    try:
        receiver.take(event)
    finally:
        done.set()
        joined(runner)
        receiver.stop_engine(30)
    assert served_digest(rollout) == weights_digest(second) and rollout.weight_version == 16
    assert seen["egress held"]  # the collective's hazard is held off in both modes
    spans = timeline.spans()
    assert find_overlaps(spans, [(SpanKind.FORWARD, SpanKind.WEIGHT_WRITE)]) == []
    assert rollout.statistics().torn_forwards == 0
    report = receiver.sync_reports[-1]
    assert report.error is None and report.paused
    on_wire = find_overlaps(spans, [(SpanKind.FORWARD, SpanKind.SYNC)])
    if mode is SyncMode.STAGED:
        assert seen["forwards went on"] and forwards_in_wire >= 3 and on_wire
        assert 0 < report.stall_s < report.total_s / 2
    else:
        assert not seen["forwards went on"] and forwards_in_wire == 0 and on_wire == []
        assert report.stall_s > report.total_s / 2
    trainer.close()


class TensorParallelEngine(PlainEngine):
    """An engine whose forwards run NCCL collectives of their own (tensor parallelism)."""

    def forward_collectives(self) -> frozenset[str]:
        return frozenset({"nccl"})


class NcclTransfer:
    """What the NCCL rule reads of an R2R transfer: its backend."""

    backend = "nccl"
    is_source = False


def test_the_staged_mode_is_checked_when_the_receiver_is_built(redis: Any) -> None:
    group = ("127.0.0.1", 1)
    with pytest.raises(ValueError, match="stage=False"):
        FastLLMReceiver(PlainEngine(), redis=redis, mode=SyncMode.STAGED, stage=False)
    with pytest.raises(ValueError, match=r"SyncMode\.SYNC"):
        FastLLMReceiver(PlainEngine(), redis=redis, mode=SyncMode.ASYNC_PER_FORWARD)
    # The NCCL rule: a staged NCCL receive beside NCCL forwards is refused, naming the way out.
    with pytest.raises(TwoCommunicatorsRefused, match=r"WeightsBroadcastConfig\.backend"):
        FastLLMReceiver(
            TensorParallelEngine(),
            redis=redis,
            group_address=group,
            backend="nccl",
            mode=SyncMode.STAGED,
        )
    for allowed in (
        {"backend": "gloo", "mode": SyncMode.STAGED},
        {"backend": "nccl", "mode": SyncMode.SYNC},
    ):
        FastLLMReceiver(TensorParallelEngine(), redis=redis, group_address=group, **allowed)
    receiver = FastLLMReceiver(TensorParallelEngine(), redis=redis, mode=SyncMode.STAGED)
    assert receiver.weight_sync_mode is SyncMode.STAGED
    with pytest.raises(TwoCommunicatorsRefused):
        receiver.r2r = NcclTransfer()  # type: ignore[assignment]
    assert receiver.r2r is None


# -- rollouts back -----------------------------------------------------------------------------


def test_rollouts_go_back_in_fast_llms_format_and_a_hold_defers_them(redis: Any) -> None:
    sender = FastLLMRolloutSender(redis, default_timeout=30)
    redis.xgroup_create(ROLLOUTS_STREAM, "fast_llm_group", id="0", mkstream=True)
    sender.submit([5, 6, 7], [-0.5, -1.0, -0.25], [32, 32, 64], {"reward": 1.0})
    sender.flush_pending_sends(30)
    with sender.hold_sends(30):
        sender.submit([8], [-0.1], [64])
        with pytest.raises(PayloadTimeout):  # held: it cannot go out while the hold lasts
            sender.flush_pending_sends(0.3)
        assert redis.xlen(ROLLOUTS_STREAM) == 1  # queued, not sent, not dropped
    sender.flush_pending_sends(30)
    assert redis.xlen(ROLLOUTS_STREAM) == 2
    entries = redis.xreadgroup("fast_llm_group", "trainer", {ROLLOUTS_STREAM: ">"}, count=10)
    records = [decode_rollout(fields) for _, fields in entries[0][1]]
    assert records[0].tokens.tolist() == [5, 6, 7]
    assert records[0].old_log_probabilities.tolist() == [-0.5, -1.0, -0.25]
    assert records[0].model_version.tolist() == [32, 32, 64]
    assert records[0].data == {"reward": 1.0}
    assert records[0].staleness(96) == 64 and records[1].staleness(96) == 32
    with pytest.raises(ValueError, match="one entry per token"):
        sender.submit([1, 2], [-1.0], [0, 0])
    sender.close(30)
    assert (sender.submitted, sender.sent, sender.failed) == (2, 2, 0)
    with pytest.raises(FastLLMProtocolError, match="closed"):
        sender.submit([1], [-1.0], [0])


def test_closing_a_held_sender_counts_what_it_could_not_send(redis: Any) -> None:
    sender = FastLLMRolloutSender(redis, default_timeout=30)
    with sender.hold_sends(30):
        sender.submit([1, 2], [-1.0, -2.0], [0, 0])
        with pytest.raises(PayloadTimeout):
            sender.close(0.2)
    assert (sender.submitted, sender.sent, sender.failed) == (1, 0, 1)
    assert redis.xlen(ROLLOUTS_STREAM) == 0


def test_a_sender_waits_for_ever_on_math_inf_and_refuses_a_negative_timeout(redis: Any) -> None:
    import math

    sender = FastLLMRolloutSender(redis, default_timeout=30)
    flushed = threading.Event()

    def flush_for_ever() -> None:
        sender.flush_pending_sends(math.inf)  # waits (an OverflowError if passed to the lock)
        flushed.set()

    with sender.hold_sends(math.inf):
        sender.submit([1], [-1.0], [0], timeout=math.inf)
        flusher = threading.Thread(target=flush_for_ever, daemon=True)
        flusher.start()
        assert not flushed.wait(0.2)  # held: the record cannot go, the flush waits
    assert flushed.wait(30)  # released: sent, and the flush returns
    flusher.join(30)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        sender.flush_pending_sends(-1.0)
    sender.close(math.inf)
    assert (sender.submitted, sender.sent, sender.failed) == (1, 1, 0)


# -- the demo ----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", [SyncMode.SYNC, SyncMode.STAGED])
def test_the_fast_llm_demo_reports_a_clean_guarded_run(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str], mode: SyncMode
) -> None:
    import json

    from rollout_sync.demos.cli import main

    argv = ["demo", "--trainer", "fast-llm", "--steps", "4", "--replicas", "2", "--json"]
    assert main(argv + (["--staged"] if mode is SyncMode.STAGED else [])) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert (report["trainer"], report["guarded"], report["replicas"]) == ("fast-llm", True, 2)
    assert report["sync_mode"] == mode.value
    # Staged, a receive parks generation for its install alone, a sliver of the sync.
    assert 0 < report["stall_ms_p99"] <= report["sync_ms_p99"]
    if mode is SyncMode.STAGED:
        assert report["stall_ms_p50"] < report["sync_ms_p50"] / 2
    # 5 versions (the initial one and 4 steps): replica 1 receives and passes each on R2R,
    # replica 2 receives it.
    assert report["syncs"] == 15 and report["versions_checked"] == 10
    assert report["torn_reads"] == 0 and report["egress_overlaps"] == 0
    assert report["bit_identical"] is True and report["failed_commands"] == 0
    assert report["payloads_lost"] == 0 and report["payloads_received"] == report["payloads_sent"]
    assert report["payloads_sent"] > 0
    assert report["final_versions"] == [report["documents_seen"]] * 2
    assert 0 <= report["staleness_p50"] <= report["staleness_max"]
    assert "OK:" in out
