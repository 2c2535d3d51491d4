"""The embedded engine: a tiny causal language model in plain torch, served for real.

:class:`TorchLMBackend` is a small GPT-style transformer (token and position embeddings, a few
pre-norm attention + MLP blocks, a head) with a per-sequence KV cache and batched, step-wise
decoding, greedy or sampled. Its parameters *are* the served tensors: a weight sync writes them
in place through :meth:`~rollout_sync.RolloutBase.load_weights`, so the hazards this package
guards against are real here, not simulated. It decodes either as a blocking call
(:meth:`TorchLMBackend.generate`, on the caller's thread) or under a
:class:`~rollout_sync.RolloutTaskScheduler` on a thread of its own
(:class:`TorchLMStreamBackend`, whose ``paused()`` parks that scheduler at a step boundary).

**What a sync does to a sequence in flight** is an explicit policy, :class:`KVCachePolicy`:

* ``RECOMPUTE`` (default): at its next step after a sync, a sequence's cache is dropped and
  rebuilt from the prompt and the tokens so far under the new weights. Its continuation is then
  exactly what the new weights produce from that context; the price is one prefill.
* ``KEEP_STALE``: the cache is kept. New tokens attend to keys and values computed under the old
  weights: cheaper, but a mix of two versions (counted in ``stale_cache_tokens``).

**Torn reads are detected, not assumed away.** Every weight write is bracketed by a sequence
counter (odd while writing, seqlock-style); every forward reads it before, between its blocks
and after. A forward that saw an odd value or two different values read tensors from two
versions: it is counted in ``torn_forwards``. With a :class:`~rollout_sync.Timeline`, each
decode step is a ``forward`` span and each write a ``weight_write`` span, so
:meth:`~rollout_sync.Timeline.overlaps` checks the same thing from the timeline.

**LoRA adapters** (:class:`~rollout_sync.lora.SupportsLoRA`): the engine serves named adapters,
each in a slot of its own (:mod:`~rollout_sync.backends.torch_lm.lora`), per request
(``GenerationRequest.adapter``): in a batched step each row adds its own adapter's delta to the
targeted linear layers, or none. A write to one adapter is torn-read counted and
cache-invalidated for the sequences on that adapter only (a per-adapter epoch under the same KV
policy); each result says which adapter version produced each token.

Deterministic: the weights come from a seed (:func:`tiny_lm_weights`), and sampling draws from a
per-sequence generator seeded from the request, whatever the batch it runs in.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...backend import KVCachePolicy, RolloutBase
from ...errors import CollectiveError, ShutdownTimeout, TornWeightsError
from ...flat import FlatWeights
from ...gate import Gate
from ...lora import LoRAConfig
from ...scheduler import (
    GenerationRequest,
    GenerationResult,
    ParkReport,
    RolloutTaskScheduler,
    SamplingParams,
    SequenceState,
)
from ...trace import SpanKind, Timeline
from ...transfer import Layout
from ...weights import check_weights_match, specs_of
from .lockstep import Lockstep, StepPlan
from .lora import AdapterSlot, LoRABatch, tiny_lm_lora_shapes
from .tensor_parallel import TensorParallel, tiny_lm_layout

__all__ = [
    "KVCachePolicy",
    "TinyCausalLM",
    "TinyLMConfig",
    "TorchLMBackend",
    "TorchLMStatistics",
    "TorchLMStreamBackend",
    "tiny_lm_lora_shapes",
    "tiny_lm_tp_layout",
    "tiny_lm_weights",
]

LayerHook = Callable[[int], None]


@dataclass(frozen=True)
class TinyLMConfig:
    """The shape of a :class:`TinyCausalLM`, and the seed of its initial weights."""

    vocab_size: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_seq_len: int = 256
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    """Seed of the initial weights (version 0) and of sampling without a request seed."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.d_model % max(self.n_heads, 1):
            problems.append(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if not self.dtype.is_floating_point:
            problems.append(f"dtype must be a floating point dtype, got {self.dtype}")
        if problems:
            raise ValueError("invalid TinyLMConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# -- the model ---------------------------------------------------------------------------------


class _Block(nn.Module):
    """Pre-norm self-attention (reading a KV cache) and MLP; with ``tp``, this rank's heads
    and MLP rows (module docstring of :mod:`~rollout_sync.backends.torch_lm.tensor_parallel`).
    ``prefix`` is its path in the model (``"blocks.0"``), which LoRA targets name."""

    def __init__(
        self, config: TinyLMConfig, tp: TensorParallel | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        d, dtype = config.d_model, config.dtype
        parts = 1 if tp is None else tp.size
        self.tp = tp
        self.prefix = prefix
        self.n_heads = config.n_heads // parts
        self.width = d // parts
        """This rank's share of the attention's width (its heads)."""
        self.ln1 = nn.LayerNorm(d, dtype=dtype)
        self.qkv = nn.Linear(d, 3 * self.width, dtype=dtype)
        self.proj = nn.Linear(self.width, d, dtype=dtype)
        self.ln2 = nn.LayerNorm(d, dtype=dtype)
        self.fc1 = nn.Linear(d, config.d_ff // parts, dtype=dtype)
        self.fc2 = nn.Linear(config.d_ff // parts, d, dtype=dtype)

    def forward(
        self,
        x: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        mask: torch.Tensor,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, p, _ = x.shape
        h, w = self.n_heads, self.width
        q, k, v = self._adapt("qkv", self.qkv, self.ln1(x), lora).split(w, dim=-1)
        q, k, v = (t.view(b, p, h, w // h).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q, torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2), attn_mask=mask
        )
        x = x + self._adapt("proj", self.proj, attn.transpose(1, 2).reshape(b, p, w), lora, True)
        hidden = F.gelu(self._adapt("fc1", self.fc1, self.ln2(x), lora))
        x = x + self._adapt("fc2", self.fc2, hidden, lora, True)
        return x, k, v

    def _adapt(
        self,
        name: str,
        linear: nn.Linear,
        x: torch.Tensor,
        lora: LoRABatch | None,
        row_parallel: bool = False,
    ) -> torch.Tensor:
        """Linear layer ``name`` on ``x``, plus the delta of each row's adapter."""
        if row_parallel:
            out = self._row_parallel(linear, x, name)
        else:
            out = linear(x)
        if lora is not None:
            out = lora.apply(f"{self.prefix}.{name}", x, out)
        return out

    def _row_parallel(self, linear: nn.Linear, x: torch.Tensor, what: str) -> torch.Tensor:
        if self.tp is None:
            return linear(x)  # type: ignore[no-any-return]
        partial = F.linear(x, linear.weight)
        return self.tp.all_reduce(partial, what) + linear.bias


class TinyCausalLM(nn.Module):
    """A small GPT-style causal LM whose forward extends per-sequence KV caches.

    Build it with :meth:`build` (deterministic weights from a seed, the global RNG untouched).
    """

    def __init__(self, config: TinyLMConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        dtype = config.dtype
        self.config = config
        self.tp = tp
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model, dtype=dtype)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model, dtype=dtype)
        self.blocks = nn.ModuleList(
            _Block(config, tp, f"blocks.{i}") for i in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.d_model, dtype=dtype)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, dtype=dtype)

    @classmethod
    def build(
        cls, config: TinyLMConfig, seed: int | None = None, *, tp: TensorParallel | None = None
    ) -> TinyCausalLM:
        """A model with weights drawn from ``seed`` (default ``config.seed``), on its device.

        With ``tp``, this rank's slice of the same model (:func:`tiny_lm_tp_layout`): the
        whole weights are drawn, then cut.
        """
        seed = config.seed if seed is None else seed
        # The modules' own initialization draws from the global RNG; fork it so that building
        # a model never changes the caller's random stream (init_weights overwrites it all).
        with torch.random.fork_rng(devices=[]):
            model = cls(config, tp)
        model = model.to(config.device)
        if tp is None:
            model.init_weights(seed)
        else:
            whole = tiny_lm_weights(config, seed)
            local = tiny_lm_tp_layout(config, tp.size).shard(whole, tp.rank)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(local[name])
        return model.eval()

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Draw every parameter from a generator seeded with ``seed``.

        Every tensor, norms included, depends on the seed, so weights of two seeds differ
        everywhere and a torn read is visible in any tensor.
        """
        gen = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            if name.startswith(("tok_emb", "pos_emb")):
                value = noise
            elif ".ln" in name or name.startswith("ln_f"):
                value = (1.0 + 0.1 * noise) if name.endswith("weight") else 0.1 * noise
            elif name.endswith("bias"):
                value = 0.02 * noise
            else:
                value = noise / math.sqrt(param.shape[-1])
            # Narrow dtypes round through float32: a bfloat16 model of a seed is then the
            # float32 model of that seed, cast (what a trainer's fp32 master serves).
            rounded = value.to(torch.float32) if param.element_size() < 4 else value
            param.copy_(rounded.to(param.dtype))

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        past_mask: torch.Tensor,
        new_mask: torch.Tensor,
        on_layer: LayerHook | None = None,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One batched step over the new tokens of each sequence.

        Args:
            tokens, positions: ``[B, P]`` new tokens (left-aligned, padded) and their positions.
            past_k, past_v: ``[n_layers, B, H, C, Dh]`` cached keys and values (padded).
            past_mask: ``[B, C]`` which cache entries are real.
            new_mask: ``[B, P]`` which new tokens are real.
            on_layer: called with ``i`` before block ``i``, and with ``n_layers`` before the
                head.
            lora: which rows read which LoRA adapter (``None``: every row on the base model).

        Returns:
            ``(logits [B, P, V], new_k, new_v [n_layers, B, H, P, Dh])``.
        """
        b, p = tokens.shape
        c = past_mask.shape[1]
        causal = torch.ones(p, p, dtype=torch.bool, device=tokens.device).tril()
        new_allowed = causal.unsqueeze(0) & new_mask.unsqueeze(1)
        mask = torch.cat([past_mask.unsqueeze(1).expand(b, p, c), new_allowed], dim=2)
        mask = mask.unsqueeze(1)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        new_k, new_v = [], []
        for i, block in enumerate(self.blocks):
            if on_layer is not None:
                on_layer(i)
            x, k, v = block(x, past_k[i], past_v[i], mask, lora)
            new_k.append(k)
            new_v.append(v)
        if on_layer is not None:
            on_layer(len(self.blocks))
        logits = self.lm_head(self.ln_f(x))
        return logits, torch.stack(new_k), torch.stack(new_v)


def tiny_lm_weights(config: TinyLMConfig, seed: int) -> dict[str, torch.Tensor]:
    """A full set of weights for ``config`` drawn from ``seed``: what a trainer would send."""
    model = TinyCausalLM.build(config, seed)
    return {name: param.detach() for name, param in model.named_parameters()}


def tiny_lm_tp_layout(config: TinyLMConfig, tp: int) -> Layout:
    """How the tiny LM of ``config`` lies on a replica of ``tp`` tensor-parallel ranks (see
    :func:`~rollout_sync.backends.torch_lm.tensor_parallel.tiny_lm_layout`): the target layout of a
    :class:`~rollout_sync.transfer.TransferPlan` from a trainer's.

    Raises:
        ValueError: the heads or the MLP do not split evenly over ``tp`` ranks.
    """
    if config.n_heads % tp:
        raise ValueError(
            f"tensor parallelism over {tp} ranks needs even splits: {config.n_heads} heads"
        )
    # Built on the CPU, not the meta device: the meta device's first use imports torch._dynamo
    # (seconds per process); the tiny model's parameters cost nothing.
    with torch.random.fork_rng(devices=[]):
        specs = specs_of(dict(TinyCausalLM(replace(config, device="cpu")).named_parameters()))
    return tiny_lm_layout(specs, config.n_layers, tp)


# -- the backend -------------------------------------------------------------------------------


class _KVState:
    """A sequence's cache: preallocated to ``max_seq_len``, ``length`` entries valid, computed
    under the weights of ``epoch`` and (a sequence on an adapter) the adapter's
    ``adapter_epoch``."""

    __slots__ = ("adapter_epoch", "epoch", "generator", "k", "length", "stale", "v")

    def __init__(self, config: TinyLMConfig, epoch: int, heads: int) -> None:
        shape = (config.n_layers, heads, config.max_seq_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=config.dtype, device=config.device)
        self.v = torch.zeros(shape, dtype=config.dtype, device=config.device)
        self.length = 0
        self.epoch = epoch
        self.adapter_epoch = 0
        self.stale = False
        self.generator: torch.Generator | None = None


@dataclass(frozen=True)
class TorchLMStatistics:
    """A snapshot of a :class:`TorchLMBackend`."""

    initialized: bool
    forwards: int
    torn_forwards: int
    """Forwards that read weights from two versions (or during a write): must stay 0."""
    tokens_processed: int
    """Token positions run through the model (prefill, recompute and decode)."""
    recomputed_tokens: int
    """Of those, positions recomputed under new weights (the recompute policy's cost)."""
    weight_writes: int
    weights_epoch: int
    weight_version: int
    weights_torn: bool
    parked: bool
    tp_error: str | None = None
    """A streaming tensor-parallel follower: what stopped it following its leader (it is then
    torn, and its replica must be restarted); ``None`` otherwise."""
    adapter_writes: int = 0
    """Writes into LoRA adapter slots (:meth:`TorchLMBackend.load_adapter`)."""


class TorchLMBackend(RolloutBase):
    """The tiny torch LM as a rollout backend; blocking :meth:`generate` on the caller's thread.

    It serves LoRA adapters per request (:class:`~rollout_sync.lora.SupportsLoRA`: a
    ``RolloutWorker`` syncs them with ``P2R(adapter=name)``), on every block's ``qkv``,
    ``proj``, ``fc1`` and ``fc2`` (:func:`tiny_lm_lora_shapes`); not with ``tp`` > 1.

    Every decode step is a section of :attr:`generation_gate`, and :meth:`paused` closes it, so
    a weight write inside ``paused()`` never meets a forward, from whichever thread
    :meth:`generate` is called. The model is built lazily by :meth:`ensure_initialized` (a
    worker calls it inside the sync bracket; :meth:`served_weights` and :meth:`generate` call it
    too).

    Args:
        config: model shape and seed; defaults to ``TinyLMConfig()``.
        kv_policy: what a sync does to cached state (module docstring).
        pause_timeout: default limit, in seconds, of ``paused()`` and of a step's wait.
        timeline: records ``forward`` and ``weight_write`` spans.
        flat_weights: keep the parameters in one flat buffer
            (:class:`~rollout_sync.flat.FlatWeights`) and declare it in
            :meth:`flat_weight_storage`, so transfers receive into it and send from it without
            staging copies. ``False``: each parameter has its own storage.
        tp: serve this rank's slice of a tensor-parallel replica
            (:class:`~rollout_sync.backends.torch_lm.tensor_parallel.TensorParallel`): the served
            tensors are the slice (:func:`tiny_lm_tp_layout` says which), and every forward
            all-reduces over the replica's group. Every rank of the replica runs the same
            :meth:`generate` calls, with the same requests, in lockstep (SPMD, as vLLM's
            workers do); greedy output equals the unsharded model's (docs/distributed.md).
            Each call starts with the ranks agreeing on their weights (servable, version):
            if they differ, every rank marks itself torn and the call raises
            :class:`~rollout_sync.errors.TornWeightsError`. Sync such a replica *between*
            :meth:`generate` calls: its ``paused()`` parks this rank only, and a rank parked
            while another is mid-step leaves that step's all-reduce waiting (the streaming
            backend parks every rank together).

    Attributes:
        layer_hook: ``None`` or a callable run inside every forward, before each block
            (index ``i``) and before the head (index ``n_layers``), on the decoding thread.
            For tests that need an exact interleaving, or a deliberately widened race window.
    """

    def __init__(
        self,
        config: TinyLMConfig | None = None,
        *,
        kv_policy: KVCachePolicy = KVCachePolicy.RECOMPUTE,
        pause_timeout: float = 60.0,
        timeline: Timeline | None = None,
        name: str = "generation",
        flat_weights: bool = True,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config if config is not None else TinyLMConfig()
        self.tp = tp
        self.tp_size = 1 if tp is None else tp.size
        if tp is not None:
            tiny_lm_tp_layout(self.config, tp.size)  # refuses a model that does not split evenly
        self.flat_weights = flat_weights
        self.kv_policy = KVCachePolicy(kv_policy)
        self.pause_timeout = pause_timeout
        self.timeline = timeline
        self.name = name
        self.generation_gate = Gate.for_generation("decode step", timeout=pause_timeout, name=name)
        self.layer_hook: LayerHook | None = None
        self._model: TinyCausalLM | None = None
        self._served: dict[str, torch.Tensor] = {}
        self._storage: torch.Tensor | None = None
        self._write_lock = threading.Lock()
        self._write_seq = 0
        self._weights_epoch = 0
        self._weight_writes = 0
        self._forwards = 0
        self._torn_forwards = 0
        self._tokens_processed = 0
        self._recomputed_tokens = 0
        self._adapters: dict[str, AdapterSlot] = {}
        """Replaced whole under the write lock when an adapter is added, so readers need none."""
        self._adapter_writes = 0
        self._announce: Callable[[StepPlan], None] | None = None
        """A tensor-parallel leader's announcement of each step (the stream backend's)."""
        self._mirrored: dict[int, _KVState] = {}
        """A tensor-parallel follower's caches, by request id."""
        self.lockstep: Lockstep | None = None
        """A streaming tensor-parallel replica's lockstep (:class:`TorchLMStreamBackend`)."""

    # -- lifecycle -----------------------------------------------------------------------------

    def initialize(self) -> None:
        """Build the model with the config's seed (weight version 0); with ``tp``, this rank's
        slice of it."""
        model = TinyCausalLM.build(self.config, tp=self.tp)
        for param in model.parameters():
            param.requires_grad_(False)
        self._served = dict(model.named_parameters())
        if self.flat_weights:
            self._storage = FlatWeights.adopt(self._served).storage
        self._model = model

    @property
    def model(self) -> TinyCausalLM:
        """The served model (built on first use)."""
        if self._model is None:
            self.ensure_initialized()
        assert self._model is not None
        return self._model

    # -- the pause -----------------------------------------------------------------------------

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[object]:
        """Park decoding between two steps for the ``with`` body (see :class:`RolloutBase`).

        Returns once the decode step in progress (if any) has finished; no step starts until
        the body exits. Re-entrant; before any decoding it returns at once.

        Raises:
            PauseTimeout: a step was still running after ``timeout`` seconds.
        """
        with self.generation_gate.exclusive(timeout):
            yield None

    # -- weights -------------------------------------------------------------------------------

    def served_weights(self) -> Mapping[str, torch.Tensor]:
        """The model's parameters by name; syncs write them in place."""
        if self._model is None:
            self.ensure_initialized()
        return self._served

    def forward_collectives(self) -> frozenset[str]:
        """With ``tp``: the tensor-parallel group's backend, which every forward all-reduces
        on; else none."""
        if self.tp is None or self.tp.group is None:
            return frozenset()
        return frozenset({str(dist.get_backend(self.tp.group)).lower()})

    def flat_weight_storage(self) -> torch.Tensor | None:
        """The flat buffer the parameters live in (``flat_weights``), else ``None``."""
        if self._model is None:
            self.ensure_initialized()
        return self._storage

    def load_weights(
        self, weights: Mapping[str, torch.Tensor], *, require_all: bool = True
    ) -> None:
        """Validate ``weights`` against the served tensors, then copy them in, in place.

        Call inside :meth:`paused` (the guard does). The write is recorded as a
        ``weight_write`` span and bracketed by the torn-read counter; it moves
        :attr:`weights_epoch`, so cached state is handled by the KV policy at each sequence's
        next step.

        Raises:
            WeightMismatchError: a name, shape or dtype does not fit; nothing was written.
            Whatever the copy raises part-way; the weights are then marked torn (generation
            refuses to run until a complete sync lands).
        """
        served = self.served_weights()
        check_weights_match(specs_of(weights), served, require_all=require_all)
        start = time.monotonic_ns()
        with self._write_lock:
            self._write_seq += 1
            try:
                super().load_weights(weights, require_all=require_all)
            except BaseException as exc:
                self.mark_weights_torn(f"load_weights failed part-way: {type(exc).__name__}: {exc}")
                raise
            finally:
                self._write_seq += 1
                self._weights_epoch += 1
                self._weight_writes += 1
        if self.timeline is not None:
            self.timeline.add_span(
                SpanKind.WEIGHT_WRITE,
                f"{self.name} load_weights",
                start,
                tensors=len(weights),
                epoch=self._weights_epoch,
            )

    def commit_weight_version(self, version: int) -> None:
        """Record that a complete sync of ``version`` landed (it also moves the epoch).

        The epoch moves here too so that a transfer writing the served tensors directly (not
        through :meth:`load_weights`) still invalidates cached state.
        """
        with self._write_lock:
            self._weights_epoch += 1
            super().commit_weight_version(version)

    @property
    def weights_epoch(self) -> int:
        """Changes whenever the served weights may have changed; not a count of syncs.
        Adapter writes do not move it (each adapter has an epoch of its own)."""
        return self._weights_epoch

    # -- LoRA adapters (rollout_sync.lora.SupportsLoRA) ----------------------------------------

    def adapter_names(self) -> list[str]:
        """The adapters served now, in the order they were added."""
        return list(self._adapters)

    def add_adapter(self, name: str, config: LoRAConfig) -> None:
        """Give adapter ``name`` a slot of zeros at version 0: requests on it produce the base
        model's tokens until a version lands. No request can use it yet, so it needs no pause;
        it may be added before the engine is built.

        Raises:
            ValueError: ``name`` is empty or served already; a target module of ``config`` is
                not a linear layer of the model (:func:`tiny_lm_lora_shapes` names them); the
                engine is tensor-parallel (``tp`` > 1: adapters are not served there).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        if self.tp_size > 1:
            raise ValueError(
                f"{type(self).__name__} does not serve LoRA adapters with tensor parallelism "
                f"(this replica has tp={self.tp_size}): serve adapter {name!r} on a replica "
                "with tp=1"
            )
        slot = AdapterSlot(config, tiny_lm_lora_shapes(self.config), self.config.device)
        with self._write_lock:
            if name in self._adapters:
                raise ValueError(
                    f"adapter {name!r} is served already (serving {list(self._adapters)}); "
                    "sync a new version of it instead (P2R(adapter=name))"
                )
            self._adapters = {**self._adapters, name: slot}

    def adapter_config(self, name: str) -> LoRAConfig:
        """The manifest of adapter ``name``. Raises KeyError for an unknown name."""
        return self._slot(name).config

    def served_adapter(self, name: str) -> Mapping[str, torch.Tensor]:
        """The tensors requests on adapter ``name`` read (names as
        :func:`~rollout_sync.lora.adapter_specs` gives them). Writing them directly is an
        in-place sync: do it inside :meth:`paused`, then :meth:`commit_adapter_version`.
        Raises KeyError for an unknown name."""
        return self._slot(name).tensors

    def load_adapter(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Validate ``tensors`` as adapter ``name``'s whole set, then copy them into its slot.

        Call inside :meth:`paused` (the worker's install does). The write is bracketed by the
        slot's torn-read counter (a forward on the adapter that it lands in is counted in
        ``torn_forwards``), recorded as a ``weight_write`` span and moves the adapter's epoch:
        sequences on it are handled by the KV policy at their next step; no other sequence is.

        Raises:
            KeyError: no adapter ``name`` is served.
            WeightMismatchError: a module is missing or unknown, or a rank, shape or dtype does
                not fit; nothing was written.
            Whatever the copy raises part-way: the adapter is then torn (requests on it are
                refused, sequences on it fail at their next step, an R2R send of it is refused:
                :meth:`check_adapter_servable`) until a complete version of it commits. The
                model's weights and the other adapters serve on.
        """
        slot = self._slot(name)
        slot.config.check(tensors, tiny_lm_lora_shapes(self.config), context=f"adapter {name!r}")
        start = time.monotonic_ns()
        with self._write_lock:
            slot.seq += 1
            try:
                with torch.no_grad():
                    for tensor_name, tensor in tensors.items():
                        target = slot.tensors[tensor_name]
                        if tensor.data_ptr() != target.data_ptr():
                            target.copy_(tensor)
            except BaseException as exc:
                slot.torn = f"load_adapter({name!r}) failed part-way: {type(exc).__name__}: {exc}"
                raise
            finally:
                slot.seq += 1
                slot.epoch += 1
                self._adapter_writes += 1
        if self.timeline is not None:
            self.timeline.add_span(
                SpanKind.WEIGHT_WRITE,
                f"{self.name} load_adapter {name}",
                start,
                tensors=len(tensors),
                adapter=name,
                epoch=slot.epoch,
            )

    def adapter_version(self, name: str) -> int:
        """The version of adapter ``name`` served now (0 before any landed). Raises KeyError
        for an unknown name."""
        return self._slot(name).version

    def commit_adapter_version(self, name: str, version: int) -> None:
        """Record that a complete ``version`` of adapter ``name`` landed. It moves the
        adapter's epoch too (a transfer that wrote :meth:`served_adapter` directly still
        invalidates the caches of sequences on it) and clears the adapter's tear. Raises
        KeyError for an unknown name."""
        slot = self._slot(name)
        with self._write_lock:
            slot.epoch += 1
            slot.version = version
            slot.torn = None

    def check_adapter_servable(self, name: str) -> None:
        """Raise :class:`~rollout_sync.errors.TornWeightsError` if adapter ``name`` is torn
        (a load failed part-way and no complete version landed since), KeyError if unknown."""
        slot = self._slot(name)
        if slot.torn is not None:
            raise TornWeightsError(
                f"adapter {name!r} of {type(self).__name__} is torn ({slot.torn}); a complete "
                "version of it must land first"
            )

    def _slot(self, name: str) -> AdapterSlot:
        slot = self._adapters.get(name)
        if slot is None:
            raise KeyError(
                f"{type(self).__name__} serves no adapter {name!r} (serving "
                f"{list(self._adapters)}); add it first: add_adapter(name, config)"
            )
        return slot

    # -- decoding ------------------------------------------------------------------------------

    def validate_request(self, request: GenerationRequest) -> None:
        """Raise ``ValueError`` naming every problem that would stop ``request`` being served."""
        cfg = self.config
        problems = []
        if not request.prompt:
            problems.append("the prompt is empty (at least one token is needed)")
        bad = [t for t in request.prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            problems.append(
                f"prompt token ids {bad[:8]} are outside the vocabulary [0, {cfg.vocab_size})"
            )
        if request.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if len(request.prompt) + request.max_new_tokens > cfg.max_seq_len:
            problems.append(
                f"prompt ({len(request.prompt)} tokens) + max_new_tokens "
                f"({request.max_new_tokens}) exceeds max_seq_len {cfg.max_seq_len}"
            )
        sampling = request.sampling
        if not sampling.temperature >= 0:
            problems.append(f"temperature must be >= 0, got {sampling.temperature!r}")
        if sampling.top_k is not None and sampling.top_k < 1:
            problems.append(f"top_k must be >= 1 or None, got {sampling.top_k!r}")
        bad_stop = [t for t in request.stop_token_ids if not 0 <= t < cfg.vocab_size]
        if bad_stop:
            problems.append(f"stop_token_ids {bad_stop[:8]} are outside the vocabulary")
        if request.adapter is not None:
            slot = self._adapters.get(request.adapter)
            if slot is None:
                problems.append(
                    f"adapter {request.adapter!r} is not served (serving "
                    f"{list(self._adapters)}; add it first: add_adapter(name, config))"
                )
            elif slot.torn is not None:
                problems.append(
                    f"adapter {request.adapter!r} is torn ({slot.torn}); a complete version of "
                    "it must land first"
                )
        if problems:
            raise ValueError(
                f"{type(self).__name__} cannot serve this request: " + "; ".join(problems)
            )

    def decode_step(self, sequences: Sequence[SequenceState]) -> None:
        """One batched forward: advance every unfinished sequence by one token.

        New sequences are prefilled in the same forward; a sequence whose cache predates the
        current weights is handled by :attr:`kv_policy`. A per-sequence failure (its logits
        processor raised) fails that sequence only; its cache is left as it was.
        Call inside a section of :attr:`generation_gate` (the scheduler does).

        Raises:
            TornWeightsError: the served weights are torn.
        """
        self.check_servable()
        self.ensure_initialized()
        cfg = self.config
        adapters = self._adapters
        live: list[SequenceState] = []
        slots: list[AdapterSlot | None] = []
        for seq in sequences:
            if seq.finished:
                continue
            slot = None if seq.request.adapter is None else adapters.get(seq.request.adapter)
            if seq.request.adapter is not None and (slot is None or slot.torn is not None):
                seq.fail(
                    TornWeightsError(
                        f"adapter {seq.request.adapter!r} is "
                        + ("not served" if slot is None else f"torn ({slot.torn})")
                    )
                )
                continue
            live.append(seq)
            slots.append(slot)
        if not live:
            return
        epoch = self._weights_epoch
        version = self.weight_version
        adapter_versions = [None if slot is None else slot.version for slot in slots]
        caches = [self._cache_for(s, epoch, slot) for s, slot in zip(live, slots, strict=True)]
        lora = self._lora_batch(live, slots)
        pending = [s.context()[kv.length :] for s, kv in zip(live, caches, strict=True)]

        batch = len(live)
        width = max(len(p) for p in pending)
        device = cfg.device
        tokens = torch.zeros(batch, width, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        new_mask = torch.zeros(batch, width, dtype=torch.bool)
        offsets = torch.arange(width)
        for b, (new, kv) in enumerate(zip(pending, caches, strict=True)):
            tokens[b, : len(new)] = torch.tensor(new, dtype=torch.long)
            positions[b] = (kv.length + offsets).clamp_(max=cfg.max_seq_len - 1)
            new_mask[b, : len(new)] = True
        if self._announce is not None:  # a tensor-parallel leader: the followers run it too
            ids = tuple(s.request_id for s in live)
            lengths = tuple(kv.length for kv in caches)
            try:
                self._announce(StepPlan(ids, lengths, tokens, positions, new_mask, version))
            except CollectiveError as exc:
                self._lockstep_broken(exc)
                raise
        logits, new_k, new_v = self._forward(caches, tokens, positions, new_mask, epoch, lora)

        last = torch.tensor([len(p) - 1 for p in pending], device=device)
        next_logits = logits[torch.arange(batch, device=device), last]
        for b, (seq, kv) in enumerate(zip(live, caches, strict=True)):
            try:
                token, logprob = self._choose(seq, kv, next_logits[b])
            except Exception as exc:
                seq.fail(exc)
                continue
            self._append(kv, new_k, new_v, b, len(pending[b]))
            if kv.stale:
                seq.stale_cache_tokens += 1
            seq.append_token(token, logprob, version, adapter_versions[b])
            if seq.finished:
                seq.engine_state = None

    def _forward(
        self,
        caches: Sequence[_KVState],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        new_mask: torch.Tensor,
        epoch: int,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One batched forward over the new ``tokens`` of sequences with these ``caches`` (and
        rows on the adapters of ``lora``), torn-read counted and recorded; returns
        ``(logits, new_k, new_v)``."""
        model = self.model
        device = self.config.device
        batch = tokens.shape[0]
        past = max(kv.length for kv in caches)
        lengths = torch.tensor([kv.length for kv in caches])
        past_mask = torch.arange(past).unsqueeze(0) < lengths.unsqueeze(1)
        past_k = torch.stack([kv.k[:, :, :past] for kv in caches], dim=1)
        past_v = torch.stack([kv.v[:, :, :past] for kv in caches], dim=1)

        # The seqlocks this forward reads under: the weights', and each adapter slot's it reads.
        def sample() -> tuple[int, ...]:
            return (self._write_seq,) if lora is None else (self._write_seq, *lora.seqs())

        seen = [sample()]
        hook = self.layer_hook

        def on_layer(index: int) -> None:
            seen.append(sample())
            if hook is not None:
                hook(index)

        start = time.monotonic_ns()
        try:
            with torch.no_grad():
                logits, new_k, new_v = model(
                    tokens.to(device),
                    positions.to(device),
                    past_k,
                    past_v,
                    past_mask.to(device),
                    new_mask.to(device),
                    on_layer,
                    lora,
                )
        except CollectiveError as exc:  # a tensor-parallel peer died or left the lockstep
            self._lockstep_broken(exc)
            raise
        seen.append(sample())
        torn = any(s % 2 for sampled in seen for s in sampled) or len(set(seen)) > 1
        n_tokens = int(new_mask.sum())
        self._forwards += 1
        self._torn_forwards += torn
        self._tokens_processed += n_tokens
        if self.timeline is not None:
            self.timeline.add_span(
                SpanKind.FORWARD,
                f"{self.name} decode step",
                start,
                batch=batch,
                tokens=n_tokens,
                epoch=epoch,
                torn=torn,
            )
        return logits, new_k, new_v

    @staticmethod
    def _append(kv: _KVState, new_k: torch.Tensor, new_v: torch.Tensor, b: int, n: int) -> None:
        kv.k[:, :, kv.length : kv.length + n] = new_k[:, b, :, :n]
        kv.v[:, :, kv.length : kv.length + n] = new_v[:, b, :, :n]
        kv.length += n

    def _reconcile(self, states: list[tuple[bool, int]]) -> None:
        """After a pause: if any rank of the replica is torn, or the ranks hold different
        versions, this rank's weights are torn too (the replica must not mix them)."""
        versions = {version for _, version in states}
        if self.weights_torn or (all(ok for ok, _ in states) and len(versions) == 1):
            return
        self.mark_weights_torn(
            "the ranks of this tensor-parallel replica disagree after a sync: (servable, "
            f"version) by rank {states}; a forward would mix them"
        )

    def _lockstep_broken(self, exc: BaseException) -> None:
        """A tensor-parallel step failed on the replica's group: the ranks may no longer serve
        the same weights in step, so this rank refuses to generate until a complete sync."""
        self.mark_weights_torn(
            f"a tensor-parallel step failed ({type(exc).__name__}: {exc}); the replica's ranks "
            "are out of step"
        )

    def _mirror(self, plan: StepPlan) -> None:
        """A tensor-parallel follower's step: the leader's announced forward, on this rank's
        slice and caches (sequences the leader no longer runs are dropped).

        Raises:
            RuntimeError: the leader runs another weight version than this rank serves (the
                step is refused: a forward must never mix two versions).
        """
        self.check_servable()
        if plan.version != self.weight_version:
            raise RuntimeError(
                f"lockstep refused: the leader steps on weight version {plan.version}, this "
                f"tensor-parallel rank serves version {self.weight_version}"
            )
        epoch = self._weights_epoch
        heads = self.config.n_heads // self.tp_size
        caches: dict[int, _KVState] = {}
        for request_id, length in zip(plan.ids, plan.lengths, strict=True):
            kv = self._mirrored.get(request_id) or _KVState(self.config, epoch, heads)
            if length > kv.length:
                raise RuntimeError(
                    f"lockstep lost: the leader's cache of request {request_id} holds {length} "
                    f"tokens, this rank's {kv.length}"
                )
            kv.length = length
            caches[request_id] = kv
        self._mirrored = caches
        batch = list(caches.values())
        _, new_k, new_v = self._forward(batch, plan.tokens, plan.positions, plan.new_mask, epoch)
        for b, kv in enumerate(batch):
            self._append(kv, new_k, new_v, b, int(plan.new_mask[b].sum()))

    def _lora_batch(
        self, live: Sequence[SequenceState], slots: Sequence[AdapterSlot | None]
    ) -> LoRABatch | None:
        """The rows of each adapter in this batch (``None``: all on the base model)."""
        rows: dict[str, list[int]] = {}
        by_name: dict[str, AdapterSlot] = {}
        for b, (seq, slot) in enumerate(zip(live, slots, strict=True)):
            if slot is not None and seq.request.adapter is not None:
                rows.setdefault(seq.request.adapter, []).append(b)
                by_name[seq.request.adapter] = slot
        if not rows:
            return None
        return LoRABatch([(r, by_name[n]) for n, r in rows.items()], self.config.device)

    def _cache_for(
        self, seq: SequenceState, epoch: int, slot: AdapterSlot | None = None
    ) -> _KVState:
        """``seq``'s cache, made current: computed under older weights (``epoch``) or an older
        write of its adapter (``slot``), it is dropped or marked stale by the KV policy."""
        kv = seq.engine_state
        if kv is None:
            kv = _KVState(self.config, epoch, self.config.n_heads // self.tp_size)
            seq.engine_state = kv
        if not isinstance(kv, _KVState):
            raise TypeError(
                f"request {seq.request_id} carries engine state of another engine "
                f"({type(kv).__name__})"
            )
        adapter_epoch = 0 if slot is None else slot.epoch
        if kv.length and adapter_epoch != kv.adapter_epoch:
            seq.adapter_write_landed = True
        if kv.length and (kv.epoch != epoch or kv.adapter_epoch != adapter_epoch):
            if self.kv_policy is KVCachePolicy.RECOMPUTE:
                self._recomputed_tokens += kv.length
                kv.length = 0
                seq.recomputes += 1
            else:
                kv.stale = True
        kv.epoch = epoch
        kv.adapter_epoch = adapter_epoch
        return kv

    def _choose(self, seq: SequenceState, kv: _KVState, logits: torch.Tensor) -> tuple[int, float]:
        """Pick the next token (greedy or sampled); returns it and its log-probability."""
        params = seq.request.sampling
        if params.logits_processor is not None:
            logits = params.logits_processor(seq.context(), logits)
        if params.temperature == 0:
            token = int(torch.argmax(logits))
            return token, float(torch.log_softmax(logits, dim=-1)[token])
        scaled = logits / params.temperature
        if params.top_k is not None and params.top_k < scaled.numel():
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, -math.inf)
        logp = torch.log_softmax(scaled, dim=-1)
        if kv.generator is None:
            seed = (
                params.seed
                if params.seed is not None
                else (self.config.seed * 1_000_003 + seq.request_id)
            )
            kv.generator = torch.Generator(device=logits.device).manual_seed(seed % (1 << 63))
        token = int(torch.multinomial(logp.exp(), 1, generator=kv.generator))
        return token, float(logp[token])

    def generate(
        self,
        prompts: Sequence[GenerationRequest | Sequence[int]],
        *,
        max_new_tokens: int = 16,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        max_concurrent: int | None = None,
        timeout: float | None = None,
        adapter: str | None = None,
    ) -> list[GenerationResult]:
        """Decode ``prompts`` to completion on the calling thread, batched; results in order.

        Prompts given as token lists are built into requests with the keyword arguments,
        ``adapter`` included (the LoRA adapter they run on; ``None``: the base model); a
        :class:`GenerationRequest` carries its own.

        Each step is a gate section: a ``paused()`` from another thread parks this call between
        two steps, and the sequences continue afterwards under the kv policy.

        Raises:
            ValueError: a request cannot be served (before anything runs).
            TornWeightsError: the served weights are torn.
            PauseTimeout: a pause held the gate for more than ``timeout`` seconds at a step.
        """
        self.ensure_initialized()
        if self.tp is not None and self.tp.size > 1 and self.lockstep is None:
            # SPMD: every rank of the replica starts this call together. They agree first on
            # the weights they serve, so that a replica whose ranks' syncs ended differently
            # refuses as a whole instead of running forwards that mix two versions.
            self._reconcile(self.tp.agree(not self.weights_torn, self.weight_version))
        self.check_servable()
        requests = [
            p
            if isinstance(p, GenerationRequest)
            else GenerationRequest(
                tuple(p),
                max_new_tokens=max_new_tokens,
                sampling=sampling if sampling is not None else SamplingParams(),
                stop_token_ids=tuple(stop_token_ids),
                adapter=adapter,
            )
            for p in prompts
        ]
        if not requests:
            return []
        scheduler = RolloutTaskScheduler(
            self,
            max_concurrent=max_concurrent or len(requests),
            gate=self.generation_gate,
            pause_timeout=self.pause_timeout,
            name=f"{self.name} generate",
        )
        ids = [scheduler.put(r) for r in requests]
        done: dict[int, GenerationResult] = {}
        while len(done) < len(ids):
            scheduler.step(timeout)
            done.update((r.request_id, r) for r in scheduler.get_all())
        return [done[i] for i in ids]

    # -- introspection -------------------------------------------------------------------------

    @property
    def torn_forwards(self) -> int:
        """Forwards that read weights of two versions; must stay 0 under the guard."""
        return self._torn_forwards

    def statistics(self) -> TorchLMStatistics:
        return TorchLMStatistics(
            initialized=self.is_initialized,
            forwards=self._forwards,
            torn_forwards=self._torn_forwards,
            tokens_processed=self._tokens_processed,
            recomputed_tokens=self._recomputed_tokens,
            weight_writes=self._weight_writes,
            weights_epoch=self._weights_epoch,
            weight_version=self.weight_version,
            weights_torn=self.weights_torn,
            parked=self.generation_gate.held,
            tp_error=(
                None
                if self.lockstep is None or self.lockstep.error is None
                else f"{type(self.lockstep.error).__name__}: {self.lockstep.error}"
            ),
            adapter_writes=self._adapter_writes,
        )

    def __repr__(self) -> str:
        c = self.config
        return (
            f"<{type(self).__name__} {c.n_layers}x{c.d_model} vocab {c.vocab_size}, "
            f"v{self.weight_version}, {self.kv_policy.value}, {self._forwards} forwards>"
        )


class TorchLMStreamBackend(TorchLMBackend):
    """The tiny torch LM under a :class:`~rollout_sync.RolloutTaskScheduler`: stream generation.

    The scheduler decodes on its own thread; :meth:`paused` parks it at a decode-step boundary
    (or drains it, with ``wait_for_active_tasks``), so the guard decorators park it with no
    special casing: a worker sets ``rollout = TorchLMStreamBackend(...)`` and decorates its
    handlers. Requests go in with :meth:`put`, results come out of :meth:`get_all`.

    **Tensor parallel** (``tp``): the replica's first rank (the leader) runs the scheduler and
    takes the requests; it announces each step to the other ranks, which run the same forward
    on their slices from a thread of their own; a pause parks every rank and ends with the
    ranks agreeing on the version they serve (:mod:`~rollout_sync.backends.torch_lm.lockstep`).
    Make the replica's group with a long timeout (a follower waits on it for the next step for
    as long as generation idles); every other wait on it is bounded by ``tp.timeout_s``.
    Requests and results are the leader's; :meth:`put` on a follower raises ``RuntimeError``.

    Args:
        max_concurrent: sequences decoded together.
        drain_on_pause: what ``paused()`` does when the caller (the guard) does not say:
            ``False`` parks at a step boundary (the default), ``True`` drains.
        Others: as :class:`TorchLMBackend`.
    """

    def __init__(
        self,
        config: TinyLMConfig | None = None,
        *,
        max_concurrent: int = 8,
        kv_policy: KVCachePolicy = KVCachePolicy.RECOMPUTE,
        pause_timeout: float = 60.0,
        drain_on_pause: bool = False,
        timeline: Timeline | None = None,
        name: str = "generation",
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(
            config,
            kv_policy=kv_policy,
            pause_timeout=pause_timeout,
            timeline=timeline,
            name=name,
            tp=tp,
        )
        self.drain_on_pause = drain_on_pause
        if tp is not None and tp.size > 1:
            self.lockstep = Lockstep(
                tp,
                gate=self.generation_gate,
                mirror=self._mirror,
                state=lambda: (not self.weights_torn, self.weight_version),
                reconcile=self._reconcile,
                fail=self.mark_weights_torn,
            )
            if self.lockstep.leader:
                self._announce = self.lockstep.announce_step
        self._started = False
        self.scheduler = RolloutTaskScheduler(
            self,
            max_concurrent=max_concurrent,
            gate=self.generation_gate,
            pause_timeout=pause_timeout,
            timeline=timeline,
            name=name,
        )

    @property
    def follower(self) -> bool:
        """A tensor-parallel rank other than the replica's first: it mirrors the leader."""
        return self.lockstep is not None and not self.lockstep.leader

    def start(self) -> None:
        """Build the model if needed and start the scheduler thread (a tensor-parallel
        follower: the thread that mirrors the leader's steps)."""
        self.ensure_initialized()
        if self.lockstep is not None and not self.lockstep.leader:
            self.lockstep.start_follower()
        else:
            self.scheduler.start()
        self._started = True

    def stop(self, timeout: float = 30.0, *, finish_active: bool = False) -> None:
        """Stop the scheduler (see :meth:`RolloutTaskScheduler.stop`) and shut down; a
        tensor-parallel leader then tells its followers, which wait for that (``timeout``).

        Raises:
            ShutdownTimeout: a follower's loop did not end within ``timeout``.
        """
        try:
            if self.follower:
                assert self.lockstep is not None
                if not self.lockstep.join_follower(timeout):
                    raise ShutdownTimeout(
                        f"tensor-parallel rank {self.lockstep.tp.rank}: its leader did not stop "
                        f"generation within {timeout:.1f} s"
                    )
                if self.lockstep.error is not None:
                    raise RuntimeError(
                        f"tensor-parallel rank {self.lockstep.tp.rank} stopped following its "
                        f"leader before the end: {type(self.lockstep.error).__name__}: "
                        f"{self.lockstep.error}"
                    ) from self.lockstep.error
            else:
                self.scheduler.stop(timeout, finish_active=finish_active)
                if self.lockstep is not None and self._started:
                    self.lockstep.announce_stop()
        finally:
            self.shutdown()

    def put(
        self,
        request: GenerationRequest | Sequence[int],
        *,
        max_new_tokens: int = 16,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] = (),
        adapter: str | None = None,
    ) -> int:
        """Queue a request (``adapter``: the LoRA adapter a bare prompt runs on); see
        :meth:`RolloutTaskScheduler.put`.

        Raises:
            ValueError: the request cannot be served (an adapter that is not served, say).
            RuntimeError: on a tensor-parallel follower (requests go to the leader).
        """
        if self.follower:
            raise RuntimeError(
                "requests go to a tensor-parallel replica's leader (its rank 0), not a follower"
            )
        return self.scheduler.put(
            request,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_token_ids=stop_token_ids,
            adapter=adapter,
        )

    def get_all(self) -> list[GenerationResult]:
        """Take every result waiting now; see :meth:`RolloutTaskScheduler.get_all`."""
        return self.scheduler.get_all()

    @contextmanager
    def paused(
        self, timeout: float | None = None, *, wait_for_active_tasks: bool | None = None
    ) -> Iterator[ParkReport]:
        """Park the scheduler for the ``with`` body; see :meth:`RolloutTaskScheduler.paused`.

        ``wait_for_active_tasks=None`` follows ``drain_on_pause``. Yields the scheduler's
        :class:`~rollout_sync.scheduler.ParkReport` (time to park, sequences in flight).
        """
        drain = self.drain_on_pause if wait_for_active_tasks is None else wait_for_active_tasks
        lockstep = self.lockstep
        if lockstep is None or not self._started:
            with self.scheduler.paused(timeout, wait_for_active_tasks=drain) as report:
                yield report
        elif lockstep.leader:
            with (
                self.scheduler.paused(timeout, wait_for_active_tasks=drain) as report,
                lockstep.leader_hold(),
            ):
                yield report
        else:
            start = time.perf_counter()
            limit = self.pause_timeout if timeout is None else timeout
            with lockstep.follower_hold(limit):
                report = ParkReport(drained=drain, park_s=time.perf_counter() - start, in_flight=0)
                if self.timeline is None:
                    yield report
                else:  # a pause span, as the leader's scheduler records one
                    with self.timeline.span(
                        SpanKind.PAUSE, f"{self.name} paused", park_ms=report.park_s * 1e3
                    ):
                        yield report
