"""Reaching a started vLLM engine: one object per engine type, with one job each.

The two backends share their weights, versions, tracing and write path; what differs is how a
call reaches the engine. That difference is an object the shared part holds, not methods a
subclass overrides (vLLM's own engines share code by composition the same way):

* :class:`AsyncLLMAccess` - an ``AsyncLLM`` whose asyncio loop runs on a thread of the
  backend's: every call is a coroutine run on that loop, bounded.
* :class:`LLMAccess` - an offline ``LLM`` in this process, stepped by one thread at a time
  inside a blocking ``generate``: calls run on the caller's thread, between engine steps, and a
  write from another thread while one steps is refused.

Both satisfy :class:`EngineAccess`, which is all the shared part and the write path
(:mod:`.write`) use. Neither starts or stops an engine: the backends own the lifecycle and
build one of these once the engine runs.
"""

from __future__ import annotations

import threading
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from ...backend import KVCachePolicy
from .calls import LoopThread

__all__ = ["AsyncLLMAccess", "EngineAccess", "LLMAccess"]

T = TypeVar("T")


class EngineAccess(Protocol):
    """What the shared part of the backends needs from a started engine."""

    def rpc(self, method: str, *args: Any, timeout: float) -> Any:
        """Call ``method`` of the worker extension on every worker; return the first answer.
        Bounded by ``timeout`` seconds."""
        ...

    def rpc_all(self, method: str, *args: Any, timeout: float) -> list[Any]:
        """:meth:`rpc`, returning every worker's answer (one per worker: tensor-parallel ranks
        in rank order)."""
        ...

    def weight_sync_client(self, timeout_s: float) -> Any:
        """vLLM's weight-sync client protocol over this engine, each call bounded by
        ``timeout_s`` (no pause: the caller's)."""
        ...

    def set_version(self, label: str, timeout: float) -> None:
        """Set vLLM's weight-version label (what results' ``weight_versions`` carry)."""
        ...

    def check_write_allowed(self, owner: str) -> None:
        """Raise if a weight write now would race generation; ``owner`` names the backend."""
        ...

    def after_write(self, kv_cache_policy: KVCachePolicy) -> None:
        """Apply what a verified write leaves to the engine (the KV policy, where no pause
        applied it)."""
        ...


class AsyncLLMAccess:
    """An ``AsyncLLM`` and the loop thread it runs on; every call from another thread, bounded.

    A write needs no rule here: the backend's pause parks the engine first, and the pause
    applies the KV policy (vLLM's ``clear_cache``).
    """

    def __init__(self, engine: Any, loop: LoopThread) -> None:
        self._engine: Any = engine
        self.loop = loop

    @property
    def engine(self) -> Any:
        """The ``AsyncLLM``; use it on :meth:`run` only. :class:`RuntimeError` once released."""
        engine = self._engine
        if engine is None:
            raise RuntimeError("the AsyncLLM was shut down")
        return engine

    def release(self) -> Any:
        """Hand the engine over to be shut down, and drop it here: an access still referenced
        afterwards (by a client, or the traceback of a failed write) must not keep the
        engine's objects alive until the interpreter exits."""
        engine, self._engine = self._engine, None
        return engine

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, operation: str) -> T:
        """Run ``coro`` on the engine's loop and wait for it, at most ``timeout`` seconds."""
        return self.loop.run(coro, timeout, operation)

    def rpc(self, method: str, *args: Any, timeout: float) -> Any:
        return self.rpc_all(method, *args, timeout=timeout)[0]

    def rpc_all(self, method: str, *args: Any, timeout: float) -> list[Any]:
        engine = self.engine

        async def call() -> Any:
            return await engine.collective_rpc(method, timeout=timeout, args=args)

        return list(self.run(call(), timeout, f"engine call {method}"))

    def weight_sync_client(self, timeout_s: float) -> Any:
        from .client import AsyncLLMWeightSyncClient

        return AsyncLLMWeightSyncClient(self.engine, run=self.run, timeout_s=timeout_s)

    def set_version(self, label: str, timeout: float) -> None:
        self.run(self.engine.update_weight_version(label), timeout, "set version")

    def check_write_allowed(self, owner: str) -> None:
        """Always allowed: the pause (the caller's) is what keeps forwards out."""

    def after_write(self, kv_cache_policy: KVCachePolicy) -> None:
        """Nothing: the pause applied the KV policy when it parked the engine."""


class LLMAccess:
    """An offline ``vllm.LLM`` in this process, stepped by at most one thread at a time.

    ``collective_rpc`` runs on the calling thread (in-process engine), between engine steps.
    :attr:`stepping` is the thread inside ``generate`` now; a write from that thread (a step
    hook) is between two steps, a write from any other would race the step.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.stepping: int | None = None
        """The id of the thread stepping the engine inside ``generate`` (``None``: idle).
        Set and cleared by that thread only."""

    def rpc(self, method: str, *args: Any, timeout: float) -> Any:
        return self.rpc_all(method, *args, timeout=timeout)[0]

    def rpc_all(self, method: str, *args: Any, timeout: float) -> list[Any]:
        return list(self.llm.collective_rpc(method, timeout=timeout, args=args))

    def weight_sync_client(self, timeout_s: float) -> Any:
        from .client import LLMWeightSyncClient

        return LLMWeightSyncClient(self.llm, timeout_s=timeout_s)

    def set_version(self, label: str, timeout: float) -> None:
        self.llm.llm_engine.set_weight_version(label)  # a local assignment: nothing to bound

    def check_write_allowed(self, owner: str) -> None:
        stepping = self.stepping
        if stepping is not None and stepping != threading.get_ident():
            raise RuntimeError(
                f"{owner}: load_weights() on one thread while generate() runs on another would "
                "race the engine step; write from generate()'s step_hook (between steps, on the "
                "generating thread) or between generate() calls, or use VLLMAsyncBackend for "
                "stream generation"
            )

    def after_write(self, kv_cache_policy: KVCachePolicy) -> None:
        if self.stepping is not None and kv_cache_policy is KVCachePolicy.RECOMPUTE:
            # Inside a step hook: sequences in flight hold KV of the old weights. Preempting
            # them makes the next step recompute it with the new ones.
            self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
