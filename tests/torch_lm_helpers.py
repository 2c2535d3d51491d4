"""Shared pieces of the scheduler and torch LM tests: a tiny model, a sync worker, references."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from conftest import wait_until as wait_until

from rollout_sync import Timeline
from rollout_sync.backends.torch_lm import (
    TinyCausalLM,
    TinyLMConfig,
    TorchLMBackend,
    tiny_lm_weights,
)
from rollout_sync.lora import LoRAConfig
from rollout_sync.testing import InProcessWorker


def tiny_config(**overrides: Any) -> TinyLMConfig:
    """A model small enough for many forwards per test; float64 so that greedy references
    computed in a different batch shape cannot flip on a near tie."""
    fields: dict[str, Any] = {
        "vocab_size": 48,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 2,
        "d_ff": 64,
        "max_seq_len": 64,
        "dtype": torch.float64,
        "seed": 0,
    }
    fields.update(overrides)
    return TinyLMConfig(**fields)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run torch single-threaded for the test (restored after): a tiny model only loses from
    intra-op threads, and on a shared 2-core machine they turn 1 ms steps into 100 ms ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class SyncWorker(InProcessWorker):
    """A rollout worker reduced to a P2R handler, guarded and unguarded, with a hook that runs
    inside the bracket before the write (to look at the parked state)."""

    def __init__(
        self, rollout: TorchLMBackend, timeline: Timeline | None = None, timeout_s: float = 10.0
    ) -> None:
        super().__init__(rollout, None, timeline, timeout_s)
        self.inside: Callable[[], None] | None = None

    def write_weights(self, version: int, weights: Mapping[str, torch.Tensor] | None) -> None:
        self.rollout.ensure_initialized()
        if self.inside is not None:
            self.inside()
        super().write_weights(version, weights)


def greedy_continuation(
    config: TinyLMConfig, weights: Mapping[str, torch.Tensor], context: Sequence[int], n: int
) -> tuple[int, ...]:
    """What ``weights`` generate greedily from ``context``: a fresh engine, nothing shared."""
    reference = TorchLMBackend(config)
    reference.load_weights(weights)
    (result,) = reference.generate([list(context)], max_new_tokens=n)
    assert result.ok, result.error
    return result.tokens


@functools.lru_cache(maxsize=64)
def _reference_model(config: TinyLMConfig, version: int) -> TinyCausalLM:
    model = TinyCausalLM.build(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_weights(config, version)[name])
    return model


def full_forward_argmax(config: TinyLMConfig, version: int, context: Sequence[int]) -> list[int]:
    """Greedy next token after every prefix of ``context`` under ``weights_of(config, version)``,
    from one uncached forward of a separate model."""
    model = _reference_model(config, version)
    n = len(context)
    empty = torch.zeros(config.n_layers, 1, config.n_heads, 0, config.head_dim, dtype=config.dtype)
    with torch.no_grad():
        logits, _, _ = model(
            torch.tensor([list(context)]),
            torch.arange(n).unsqueeze(0),
            empty,
            empty,
            torch.zeros(1, 0, dtype=torch.bool),
            torch.ones(1, n, dtype=torch.bool),
        )
    return [int(t) for t in logits[0].argmax(dim=-1)]


@functools.lru_cache(maxsize=64)
def _weights(config: TinyLMConfig, version: int) -> dict[str, torch.Tensor]:
    return tiny_lm_weights(config, config.seed if version == 0 else 1000 + version)


def weights_of(config: TinyLMConfig, version: int) -> dict[str, torch.Tensor]:
    """The weights a trainer sends as ``version`` (version 0 is the engine's initial set).

    A fresh dict each call (callers may edit it); the tensors are shared and must not be
    written."""
    return dict(_weights(config, version))


class Runner:
    """Runs ``fn`` on a thread, keeps its result or exception; ``join`` re-raises."""

    def __init__(self, fn: Callable[[], Any], name: str = "runner") -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def join(self, timeout: float = 10.0) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"{self._thread.name} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result


def greedy_lora_continuation(
    config: TinyLMConfig,
    weights: Mapping[str, torch.Tensor],
    lora: LoRAConfig,
    adapter: Mapping[str, torch.Tensor],
    context: Sequence[int],
    n: int,
) -> tuple[int, ...]:
    """What ``weights`` with the LoRA ``adapter`` (of ``lora``) generate greedily from
    ``context``: a fresh engine, nothing shared."""
    reference = TorchLMBackend(config)
    reference.load_weights(weights)
    reference.add_adapter("reference", lora)
    reference.load_adapter("reference", adapter)
    reference.commit_adapter_version("reference", 1)
    (result,) = reference.generate([list(context)], max_new_tokens=n, adapter="reference")
    assert result.ok, result.error
    return result.tokens


class ForwardCounter:
    """A backend's ``layer_hook`` that counts its forwards (the hook runs before block 0 of
    each) and wakes whoever waits for a count: an event to wait on, instead of polling the
    backend's statistics. ``inner`` is another hook it passes every call on to."""

    def __init__(self, backend: TorchLMBackend, inner: Callable[[int], None] | None = None) -> None:
        self.count = 0
        self.inner = inner
        self._changed = threading.Condition()
        backend.layer_hook = self

    def __call__(self, index: int) -> None:
        if index == 0:
            with self._changed:
                self.count += 1
                self._changed.notify_all()
        if self.inner is not None:
            self.inner(index)

    def wait_for(self, count: int, timeout: float) -> bool:
        """Whether ``count`` forwards had started within ``timeout`` seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: self.count >= count, timeout)
