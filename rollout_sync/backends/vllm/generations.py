"""Requests on a vLLM engine and their results, dated by weight version.

:class:`VLLMRequest` is a submitted request: its tokens as they arrive, then its
:class:`VLLMGeneration`. Every result says under which served version it was admitted (first
scheduled), under which its last token was produced, and whether it straddled a sync. The
engine's own timestamps are compared with the times versions were committed
(:class:`VersionHistory`; Linux's monotonic clock is one clock for all processes).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import GenerationTimeout

__all__ = ["VLLMGeneration", "VLLMRequest", "VersionHistory"]


@dataclass(frozen=True)
class VLLMGeneration:
    """One finished request, with the weight versions it was generated under.

    ``admitted_version``: served when the engine first scheduled it (a request submitted during
    a sync is admitted under the version that sync commits). ``completed_version``: served when
    its last token was produced. Both come from the engine's own timestamps (engine stats, on
    by default in :class:`VLLMEngineConfig`); without them a request is dated by when it was
    submitted and when its end reached this process, which may report a straddle that did not
    happen but never hides one. ``error`` is set (and ``finish_reason`` may be ``None``) when
    it failed; a failed request is reported, never dropped.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str | None
    admitted_version: int
    completed_version: int
    error: str | None = None
    weight_versions: tuple[tuple[str, int, int], ...] | None = None
    """vLLM's own labels: ``(version, start, end)`` spans over the output tokens, one per
    weight version that sampled them (``finish_weight_update(version)`` sets the label);
    ``None`` when vLLM reported none (no version was ever set)."""
    arrival_versions: tuple[int, ...] = ()
    """The backend's stamps: for each output token, the version served when it reached this
    process. Exact under the guard's pause (every output produced before a pause arrives
    before the sync commits); unguarded, a token produced just before a commit may be
    stamped with the new version."""
    adapter: str | None = None
    """The LoRA adapter the request ran on (``None``: the base model)."""
    token_adapter_versions: tuple[int, ...] = ()
    """For each output token, the version of ``adapter`` served when it reached this process
    (empty on the base model). Exact under the pause, as :attr:`arrival_versions` are: an
    adapter install commits its version inside the pause, after every earlier output
    arrived. vLLM labels no adapter version of its own."""
    token_logprobs: tuple[float, ...] = ()
    """For each output token, the log-probability vLLM reported for it (the request asked for
    some: ``SamplingParams(logprobs=0)`` or more); empty when it asked for none. Which one
    depends on the engine's :attr:`~rollout_sync.backends.vllm.VLLMEngineConfig.logprobs_mode`:
    vLLM's default, ``"raw_logprobs"``, is taken from the model's logits before temperature;
    ``"processed_logprobs"`` is that of the distribution the token was sampled from (after
    temperature, top-k and top-p): the behaviour log-probability an RL learner needs."""

    @property
    def token_weight_versions(self) -> tuple[int, ...]:
        """The weight version that produced each output token (as the stream scheduler's
        results give it): vLLM's own label where one covers the token and reads as a version
        number (the backend's native writes set them), the arrival stamp elsewhere."""
        versions = list(self.arrival_versions)
        for label, start, end in self.weight_versions or ():
            try:
                version = int(label)
            except ValueError:
                continue
            for i in range(start, min(end, len(versions))):
                versions[i] = version
        return tuple(versions)

    @property
    def straddled(self) -> bool:
        """Whether a weight sync landed while this request was in flight."""
        return self.admitted_version != self.completed_version

    @property
    def ok(self) -> bool:
        return self.error is None


def _sampled_logprobs(tokens: Sequence[int], logprobs: Any) -> tuple[tuple[float, ...], str | None]:
    """Each sampled token's entry of vLLM's per-position logprobs (a list of ``{token id:
    Logprob}``, or its ``FlatLogprobs``, which indexes the same way), ``()`` when none were
    asked for; and an error when they do not cover every token (vLLM always reports the
    sampled token, so that is a broken result, reported on it, never a short tuple)."""
    if not logprobs:
        return (), None
    try:
        return tuple(float(logprobs[i][token].logprob) for i, token in enumerate(tokens)), None
    except Exception as exc:  # noqa: BLE001 - whatever vLLM handed over: a broken result
        return (), (
            f"vLLM reported no logprob for some of the {len(tokens)} generated tokens "
            f"({type(exc).__name__}: {exc})"
        )


class VersionHistory:
    """When each served weight version was committed, on ``time.monotonic()``'s clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times: list[float] = [-math.inf]
        self._versions: list[int] = [0]

    @property
    def latest(self) -> int:
        """The version served now (read without the lock: appending to a list is atomic)."""
        return self._versions[-1]

    def commit(self, version: int, at: float) -> None:
        with self._lock:
            at = max(at, self._times[-1])
            self._times.append(at)
            self._versions.append(version)

    def at(self, when: float) -> int:
        """The version served at monotonic time ``when``."""
        with self._lock:
            return self._versions[bisect.bisect_right(self._times, when) - 1]


class VLLMRequest:
    """A submitted request: watch its tokens arrive, then take its :class:`VLLMGeneration`.

    Thread-safe. Every wait takes a timeout and raises
    :class:`~rollout_sync.errors.GenerationTimeout` naming the request.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        versions: VersionHistory,
        *,
        adapter: str | None = None,
        adapter_versions: VersionHistory | None = None,
    ) -> None:
        """``adapter``/``adapter_versions``: the LoRA adapter it runs on and when each of its
        versions was committed (both or neither)."""
        if (adapter is None) != (adapter_versions is None):
            raise ValueError("VLLMRequest: adapter and adapter_versions go together")
        self.request_id = request_id
        self.prompt_token_ids = tuple(int(t) for t in prompt_token_ids)
        self.adapter = adapter
        self._adapter_versions = adapter_versions
        self._adapter_stamps: list[int] = []
        self._versions = versions
        self._cond = threading.Condition()
        self._tokens: tuple[int, ...] = ()
        self._finish_reason: str | None = None
        self._scheduled_ts = 0.0
        self._last_token_ts = 0.0
        self._weight_versions: Any = None
        self._logprobs: Any = None
        self._arrival_versions: list[int] = []
        self._result: VLLMGeneration | None = None
        self.submitted_at = time.monotonic()

    def __repr__(self) -> str:
        state = "done" if self._result is not None else "running"
        return f"<VLLMRequest {self.request_id} {state}: {len(self._tokens)} tokens>"

    def _update(self, output: Any) -> None:
        """Take one ``RequestOutput`` (cumulative) from the engine."""
        completion = output.outputs[0] if output.outputs else None
        metrics = getattr(output, "metrics", None)
        with self._cond:
            if completion is not None:
                self._tokens = tuple(completion.token_ids)
                arrived = len(self._tokens) - len(self._arrival_versions)
                if arrived > 0:
                    self._arrival_versions.extend([self._versions.latest] * arrived)
                    if self._adapter_versions is not None:
                        self._adapter_stamps.extend([self._adapter_versions.latest] * arrived)
                self._finish_reason = completion.finish_reason
                # vLLM's spans, kept as they are; converted once, in _complete.
                self._weight_versions = getattr(completion, "weight_versions", None) or None
                # Cumulative, like the tokens: converted once, in _complete.
                self._logprobs = completion.logprobs
            if metrics is not None:
                self._scheduled_ts = float(getattr(metrics, "scheduled_ts", 0.0) or 0.0)
                self._last_token_ts = float(getattr(metrics, "last_token_ts", 0.0) or 0.0)
            self._cond.notify_all()

    def _complete(self, error: str | None) -> None:
        with self._cond:
            if self._result is not None:
                return
            ended = time.monotonic()
            logprobs, broken = _sampled_logprobs(self._tokens, self._logprobs)
            admitted = self._scheduled_ts or self.submitted_at
            completed = self._last_token_ts or ended
            self._result = VLLMGeneration(
                request_id=self.request_id,
                prompt_token_ids=self.prompt_token_ids,
                token_ids=self._tokens,
                finish_reason=self._finish_reason,
                admitted_version=self._versions.at(admitted),
                completed_version=self._versions.at(completed),
                error=error or broken,
                weight_versions=(
                    None
                    if self._weight_versions is None
                    else tuple(
                        (str(span.version), int(span.start), int(span.end))
                        for span in self._weight_versions
                    )
                ),
                arrival_versions=tuple(self._arrival_versions[: len(self._tokens)]),
                adapter=self.adapter,
                token_adapter_versions=tuple(self._adapter_stamps[: len(self._tokens)]),
                token_logprobs=logprobs,
            )
            self._cond.notify_all()

    @property
    def done(self) -> bool:
        return self._result is not None

    def tokens(self) -> tuple[int, ...]:
        """The tokens generated so far."""
        with self._cond:
            return self._tokens

    def wait_for_tokens(self, count: int, timeout: float) -> tuple[int, ...]:
        """Block until ``count`` tokens exist (or the request ended); return them."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._tokens) >= count or self.done, timeout):
                raise GenerationTimeout(
                    f"request {self.request_id} did not produce {count} tokens "
                    f"within {timeout:.1f} s (has {len(self._tokens)})"
                )
            return self._tokens

    def result(self, timeout: float) -> VLLMGeneration:
        """Block until the request ended (finished, aborted or failed) and return its result."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._result is not None, timeout):
                raise GenerationTimeout(
                    f"request {self.request_id} did not finish within "
                    f"{timeout:.1f} s ({len(self._tokens)} tokens so far)"
                )
            assert self._result is not None
            return self._result
