"""Park vLLM at the next step boundary without waiting for a message to cross the engine's loop.

vLLM pauses its scheduler when a ``pause_scheduler`` utility message reaches the engine core.
While the engine generates, that message waits behind the step in progress *and* behind the
engine core's busy loop for the interpreter lock its input thread needs, then its reply waits
behind the step's outputs: on a tiny model, measured, about 1.5 decode steps in all
(``benchmarks/vllm_pause.py``).

A :class:`ParkFlag` is one byte in a memory-mapped file shared by the backend's process and the
engine core. The engine core runs :func:`parking_scheduler`, vLLM's own scheduler (the
synchronous or the asynchronous one, whichever vLLM chose) with one addition: each
``schedule()`` first reads the byte, and when it is raised sets vLLM's keep-mode pause state
itself, so the step after the raise schedules nothing. No thread hand-off, no message: the
engine is parked at the first step boundary after the raise.

The flag does not replace vLLM's pause, it leads it: the backend raises the flag and sends the
usual ``pause_scheduler(mode="keep")``. That call finishes the pause as vLLM does (device
synchronized, caches per the KV policy) and its reply comes on the same ordered channel as the
outputs, so once it is in, every output produced before the pause has reached its request. It
is answered quickly because the engine is already idle when it arrives. While the flag is
raised a resume from anyone else is undone at the next ``schedule()``; the backend lowers the
flag before it resumes.

The engine finds the flag through ``additional_config["rollout_sync_park_flag"]`` (its path);
an engine without that key schedules exactly as vLLM's scheduler does.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.scheduler import Scheduler

__all__ = [
    "PARKING_SCHEDULER",
    "PARK_FLAG_KEY",
    "ParkFlag",
    "ParkingAsyncScheduler",
    "ParkingScheduler",
    "parking_scheduler",
]

PARK_FLAG_KEY = "rollout_sync_park_flag"
"""The ``additional_config`` key holding the flag file's path."""

PARKING_SCHEDULER = f"{__name__}.parking_scheduler"
"""What to pass as vLLM's ``scheduler_cls``."""


class ParkFlag:
    """The backend's side: a one-byte flag in a file, mapped into memory.

    :meth:`raise_` and :meth:`lower` are single byte stores, visible to the engine core at its
    next ``schedule()``. :meth:`close` unmaps and removes the file.
    """

    def __init__(self, directory: str | None = None) -> None:
        fd, self.path = tempfile.mkstemp(prefix="rollout_sync_park_", dir=directory)
        try:
            os.write(fd, b"\0")
            self._map: mmap.mmap | None = mmap.mmap(fd, 1)
        finally:
            os.close(fd)

    def raise_(self) -> None:
        self._mapped()[0] = 1

    def lower(self) -> None:
        self._mapped()[0] = 0

    @property
    def raised(self) -> bool:
        return bool(self._mapped()[0])

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM engine arguments that make the engine read this flag."""
        return {"scheduler_cls": PARKING_SCHEDULER, "additional_config": {PARK_FLAG_KEY: self.path}}

    def close(self) -> None:
        mapped, self._map = self._map, None
        if mapped is not None:
            mapped.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            raise RuntimeError("the park flag is closed")
        return self._map

    def __repr__(self) -> str:
        state = "closed" if self._map is None else "raised" if self.raised else "lowered"
        return f"<ParkFlag {self.path} {state}>"


class _ParksOnFlag:
    """Mixed into vLLM's scheduler: park (keep mode) when the flag is raised."""

    _park_flag: mmap.mmap | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = getattr(self.vllm_config, "additional_config", None)  # type: ignore[attr-defined]
        path = config.get(PARK_FLAG_KEY) if isinstance(config, dict) else None
        self._park_flag = None
        if path is not None:
            with open(path, "rb") as file:
                self._park_flag = mmap.mmap(file.fileno(), 1, access=mmap.ACCESS_READ)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        flag = self._park_flag
        if flag is not None and flag[0] and self.pause_state == PauseState.UNPAUSED:  # type: ignore[attr-defined]
            self.set_pause_state(PauseState.PAUSED_ALL)  # type: ignore[attr-defined]
        return super().schedule(*args, **kwargs)  # type: ignore[misc]


class ParkingScheduler(_ParksOnFlag, Scheduler):
    """vLLM's synchronous scheduler, parking on the flag."""


class ParkingAsyncScheduler(_ParksOnFlag, AsyncScheduler):
    """vLLM's asynchronous scheduler, parking on the flag."""


def parking_scheduler(*args: Any, vllm_config: Any, **kwargs: Any) -> Scheduler:
    """vLLM's ``scheduler_cls``: the scheduler vLLM would have chosen, parking on the flag."""
    parking = (
        ParkingAsyncScheduler if vllm_config.scheduler_config.async_scheduling else ParkingScheduler
    )
    return parking(*args, vllm_config=vllm_config, **kwargs)
