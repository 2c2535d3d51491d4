"""Calls into a vLLM engine from other threads: run a coroutine on the engine's event loop with
a limit, and park an ``AsyncLLM`` at a step boundary.

Shared by the backends (:mod:`.backend`) and the weight-sync clients (:mod:`.client`); it
imports neither.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ...errors import EngineCallTimeout

__all__ = ["LoopThread", "park_engine", "run_coroutine"]

T = TypeVar("T")


async def park_engine(engine: Any, mode: str, clear_cache: bool, *, confirm: bool = True) -> None:
    """Pause an ``AsyncLLM`` at a step boundary and confirm it.

    vLLM's ``pause_generation`` ends with a fixed 20 ms sleep, "not required for correctness":
    this asks the engine core's scheduler directly (the same call, the same cache clearing)
    and confirms with ``is_paused``. The scheduler's pause completes once the engine is idle,
    and outputs and utility replies share one ordered channel: when the confirmation is in,
    every output produced before the pause has reached its request. Falls back to
    ``pause_generation`` on an engine without that scheduler call.

    ``confirm`` asks ``is_paused`` afterwards (one more round trip). An engine parked by a
    raised :class:`~rollout_sync.backends.vllm.park.ParkFlag` needs no confirmation: its
    scheduler re-parks at the next step whoever resumes it while the flag is up.

    Raises:
        RuntimeError: the engine reported itself not paused right after (another client
        resumed it); a resume is queued, so the engine is not left half-paused.
    """
    core = getattr(engine, "engine_core", None)
    pause_scheduler = getattr(core, "pause_scheduler_async", None)
    if pause_scheduler is None:
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)
    else:
        renderer = getattr(engine, "renderer", None)
        if clear_cache and renderer is not None:
            await renderer.clear_mm_cache_async()
        await pause_scheduler(mode=mode, clear_cache=clear_cache)
    if confirm and not await engine.is_paused():
        await engine.resume_generation()
        raise RuntimeError(
            "vLLM reported the engine not paused right after pausing it; another client resumed it"
        )


def run_coroutine(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], timeout: float, operation: str
) -> T:
    """Run ``coro`` on ``loop`` (running on another thread) and wait for it; raise
    :class:`EngineCallTimeout` after ``timeout`` seconds (the coroutine is cancelled), and
    :class:`RuntimeError` when called on the loop's own thread, where waiting would deadlock."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise RuntimeError(
            f"{operation} was called on the engine's own event loop thread, "
            "where waiting for it would deadlock"
        )
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise EngineCallTimeout(f"{operation} did not complete within {timeout:.1f} s") from None


class LoopThread:
    """An asyncio loop on a daemon thread; run coroutines on it from any thread, with a limit."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, operation: str) -> T:
        """:func:`run_coroutine` on this loop."""
        return run_coroutine(self.loop, coro, timeout, operation)

    def stop(self, timeout: float) -> None:
        """Cancel the tasks still on the loop, stop it and join its thread."""
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            try:
                self.submit(cancel_all()).result(timeout)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                pass  # stop regardless; the daemon thread dies with the process
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
