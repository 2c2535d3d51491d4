"""Choosing a weight-sync design: every design the refit cost model knows, for one model on one
fleet, ranked by refit and by stall, with the device memory each needs and a recommendation.

Pure arithmetic over :mod:`rollout_sync.scale` (no process, no device); ``rollout-sync plan`` is
its command. :func:`build_plan` takes the weights (:class:`ModelSpec`: given, or read from a
safetensors index or a Hugging Face ``config.json`` by :func:`model_from_file`) and the fleet
(:class:`FleetSpec`) and returns a :class:`Plan`.

The rules, in order of importance:

1. **The numbers are the cost model's.** Each design is :func:`~rollout_sync.scale.estimate` on
   a :class:`~rollout_sync.scale.Fleet` built from the inputs with everything else taken from
   ``base`` (:data:`~rollout_sync.scale.FLEET_1T` by default: its NIC latency, NVLink, node of
   8 and costs, H100-class, each with its source in ``FLEET_1T.sources``); a plan lists the
   ones it rests on in :attr:`Plan.assumptions`. On ``FLEET_1T``'s own shape a plan's in-place
   and host-staged designs are exactly ``FLEET_1T.estimates()``.
2. **The designs.** Every :class:`~rollout_sync.scale.Topology` (its alias ``SHARDED`` is
   ``SHARDED_PIPELINED``) in place, staged in device memory (installed by an HBM copy,
   ``Fleet.device_install_bytes_per_s``) and staged in host memory (installed over PCIe,
   ``SyncCosts.install_bytes_per_s``); with a changed fraction, one delta design per topology
   (:func:`delta_bytes` says its encoding; docs/delta.md). Whether a design runs today is
   :attr:`Topology.implemented <rollout_sync.scale.Topology.implemented>`, and for a delta
   design :attr:`Topology.delta_implemented <rollout_sync.scale.Topology.delta_implemented>`
   too (every topology but the pipelined sharded relay).
3. **Memory per replica GPU**, beyond the served weights: the transfer's bucket buffers (two
   where a replica GPU sends, as the first replica's does with several replicas, whether it
   relays each bucket or sends R2R after P2R; else one receive buffer; a bucket no larger than
   what passes through the GPU), plus, staged in device memory, the GPU's shard (``model bytes
   / GPUs per replica``) as a second copy. Staged in host memory, the shard is in host memory
   (:attr:`Design.host_memory_bytes_per_gpu`) and the device holds the buckets alone.
4. **Fits**: a design's memory per GPU is at most the free memory given; ``None`` (unknown) when
   none was.
5. **The recommendation**: among the implemented designs that fit (all implemented ones when no
   free memory was given), the fastest refit, or instead one whose refit is within
   :data:`CLOSE_REFIT` (5%) of it with a shorter stall (about the same refit for a much shorter
   stall). ``None`` when no implemented design fits; :attr:`Plan.reason` says why either way.

Inputs are checked when built: a :class:`ValueError` names the field and what it must be.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .scale import FLEET_1T, Fleet, Link, RefitEstimate, Topology, estimate

__all__ = [
    "CLOSE_REFIT",
    "DTYPE_BYTES",
    "Design",
    "FleetSpec",
    "ModelSpec",
    "Plan",
    "Staging",
    "build_plan",
    "delta_bytes",
    "dtype_bytes",
    "fleet_of",
    "format_bytes",
    "model_from_config",
    "model_from_file",
    "model_from_index",
    "parse_bytes",
    "parse_rate",
]

CLOSE_REFIT = 0.05
"""A design whose refit is within this fraction of the fastest is as fast, for the
recommendation (rule 5); the benchmark's "best implemented" uses the same tolerance."""

DTYPE_BYTES: Mapping[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8": 1,
}
"""Bytes per element of each dtype :func:`dtype_bytes` knows, by its canonical name."""

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e4m3fnuz": "fp8",
    "float8_e5m2": "fp8",
    "float8_e5m2fnuz": "fp8",
}


def dtype_bytes(name: str) -> tuple[str, int]:
    """The canonical name of dtype ``name`` (``bf16``, ``torch.bfloat16`` and ``bfloat16`` are
    ``"bfloat16"``) and its bytes per element; :class:`ValueError` for one it does not know."""
    key = name.strip().lower().removeprefix("torch.")
    canonical = _DTYPE_ALIASES.get(key, key)
    if canonical not in DTYPE_BYTES:
        raise ValueError(
            f"unknown dtype {name!r}: pass one of {', '.join(DTYPE_BYTES)} "
            f"(or {', '.join(sorted(_DTYPE_ALIASES))})"
        )
    return canonical, DTYPE_BYTES[canonical]


# -- units ------------------------------------------------------------------------------------

_NUMBER = r"(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_RATE = re.compile(_NUMBER + r"\s*(?P<prefix>[kKMGT]?)(?P<unit>[bB])/s")
_BYTES = re.compile(_NUMBER + r"\s*(?P<prefix>[kKMGT]i?|)(?P<unit>[bB])")


def parse_rate(text: str) -> float:
    """A link's rate in bytes per second, from ``"50GB/s"``, ``"400Gb/s"``, ``"800 MB/s"``:
    decimal prefixes (k, M, G, T), ``B`` bytes and ``b`` bits. :class:`ValueError` for anything
    else (``"50GBps"``, ``"fast"``, a number without its unit) or a rate that is not > 0."""
    found = _RATE.fullmatch(text.strip())
    if found is None:
        raise ValueError(
            f"{text!r} is not a rate: write a number and its unit per second, e.g. 50GB/s or "
            "400Gb/s (decimal k, M, G, T; B bytes, b bits)"
        )
    rate = float(found["number"]) * _DECIMAL[found["prefix"]]
    rate /= 8 if found["unit"] == "b" else 1
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"{text!r}: a rate must be > 0")
    return rate


def parse_bytes(text: str) -> int:
    """A size in bytes, from ``"20GB"``, ``"512 MB"``, ``"1.5TB"`` (decimal) or ``"20GiB"``
    (binary). :class:`ValueError` for anything else (a size in bits, ``"20G"``, ``"lots"``) or
    a size that is not > 0."""
    found = _BYTES.fullmatch(text.strip())
    if found is None or found["unit"] == "b":
        raise ValueError(
            f"{text!r} is not a size in bytes: write a number and its unit, e.g. 20GB, 512MB or "
            "20GiB (decimal k, M, G, T or binary Ki, Mi, Gi, Ti; B bytes)"
        )
    prefix = found["prefix"]
    scale = _BINARY[prefix] if prefix.endswith("i") else _DECIMAL[prefix]
    size = float(found["number"]) * scale
    if not (size >= 1 and math.isfinite(size)):
        raise ValueError(f"{text!r}: a size must be at least 1 byte")
    return round(size)


# -- the inputs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """The weights a sync moves: their bytes, their elements and their named tensors."""

    params: int
    """Elements (parameters) in the served weights: at least 1."""
    dtype: str
    """The served dtype's canonical name (a key of :data:`DTYPE_BYTES`)."""
    tensors: int
    """Named tensors (the manifest's validation scales with them): at least 1."""
    model_bytes: int
    """The bytes a sync moves: ``params x`` the dtype's bytes, unless read from a safetensors
    index (its ``metadata.total_size``, whatever mix of dtypes it holds)."""
    source: str = "given"
    """Where the numbers come from: ``"given"``, or the file and how it was read."""
    estimated: bool = False
    """The parameter and tensor counts are estimated (from a ``config.json``), not counted."""

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)  # raises for an unknown one
        for name in ("params", "tensors", "model_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"ModelSpec.{name} must be a whole number >= 1, got {value!r}")

    @classmethod
    def of(cls, params: float, tensors: int, dtype: str = "bfloat16") -> ModelSpec:
        """``params`` parameters (``70e9``) of ``dtype`` in ``tensors`` named tensors."""
        canonical, itemsize = dtype_bytes(dtype)
        if not (math.isfinite(params) and params >= 1):
            raise ValueError(f"the parameter count must be >= 1, got {params!r}")
        count = round(params)
        return cls(count, canonical, tensors, count * itemsize)

    @property
    def bytes_per_element(self) -> int:
        return dtype_bytes(self.dtype)[1]


@dataclass(frozen=True)
class FleetSpec:
    """The fleet a sync runs on: the trainer's ranks, the replicas, their links and memory."""

    trainer_ranks: int
    """GPUs (ranks) of the trainer, each holding a shard of the weights: at least 1."""
    replicas: int
    """Rollout replicas: at least 1."""
    gpus_per_replica: int
    """GPUs of one replica, each serving its shard: at least 1."""
    nic_bytes_per_s: float
    """Every GPU's NIC, one way: > 0."""
    free_memory_bytes: int | None = None
    """Device memory free on each replica GPU beside its weights (for buckets and staging);
    ``None``: not known, and :attr:`Design.fits` says ``None``."""
    bucket_bytes: int = FLEET_1T.bucket_bytes
    """The transfer's bucket: at least 1 byte."""

    def __post_init__(self) -> None:
        for name in ("trainer_ranks", "replicas", "gpus_per_replica", "bucket_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"FleetSpec.{name} must be a whole number >= 1, got {value!r}")
        if not (self.nic_bytes_per_s > 0 and math.isfinite(self.nic_bytes_per_s)):
            raise ValueError(f"FleetSpec.nic_bytes_per_s must be > 0, got {self.nic_bytes_per_s}")
        if self.free_memory_bytes is not None and not self.free_memory_bytes >= 1:
            raise ValueError(
                f"FleetSpec.free_memory_bytes must be >= 1 (or None), got {self.free_memory_bytes}"
            )


# -- reading a model from its files -----------------------------------------------------------


def model_from_file(path: str | Path, dtype: str | None = None) -> ModelSpec:
    """The weights of a checkpoint, from its safetensors index (``model.safetensors.index.json``:
    :func:`model_from_index`) or its Hugging Face ``config.json`` (:func:`model_from_config`, an
    estimate), told apart by their keys (``weight_map``, ``hidden_size``).

    ``OSError`` if the file cannot be read; :class:`ValueError` if it is not JSON, or neither.
    """
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from None
    if isinstance(data, dict) and "weight_map" in data:
        return model_from_index(data, dtype=dtype, source=f"safetensors index {path}")
    if isinstance(data, dict) and ("hidden_size" in data or "text_config" in data):
        return model_from_config(data, dtype=dtype, source=f"config.json {path}")
    raise ValueError(
        f"{path} is neither a safetensors index (no 'weight_map') nor a Hugging Face "
        "config.json (no 'hidden_size'): pass model.safetensors.index.json or config.json"
    )


def model_from_index(
    index: Mapping[str, Any], *, dtype: str | None = None, source: str = "safetensors index"
) -> ModelSpec:
    """A safetensors index counted: the bytes are its ``metadata.total_size``, the tensors its
    ``weight_map``'s names; the parameters are those bytes over ``dtype``'s (bfloat16 unless
    given: the index does not say)."""
    metadata = index.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, Mapping) else None
    if isinstance(total, float) and total.is_integer():
        total = int(total)
    if not (isinstance(total, int) and not isinstance(total, bool) and total >= 1):
        raise ValueError(
            f"{source}: metadata.total_size must be the checkpoint's bytes (a whole number >= 1), "
            f"got {total!r}"
        )
    weight_map = index.get("weight_map")
    if not (isinstance(weight_map, Mapping) and weight_map):
        raise ValueError(f"{source}: weight_map must name at least one tensor")
    canonical, itemsize = dtype_bytes(dtype or "bfloat16")
    return ModelSpec(
        params=max(1, total // itemsize),
        dtype=canonical,
        tensors=len(weight_map),
        model_bytes=total,
        source=f"{source}: metadata.total_size bytes, weight_map's {len(weight_map)} names",
    )


def model_from_config(
    config: Mapping[str, Any], *, dtype: str | None = None, source: str = "config.json"
) -> ModelSpec:
    """An estimate from a Hugging Face ``config.json`` of a decoder (a ``text_config`` inside
    it, if it has one): embeddings and the LM head (one if ``tie_word_embeddings``, absent:
    untied), per layer attention (grouped-query from ``num_attention_heads`` and
    ``num_key_value_heads``, ``head_dim``; multi-head latent attention where ``kv_lora_rank``
    is set), the MLP (three projections of ``intermediate_size``) or, in a mixture-of-experts
    layer (``n_routed_experts``, ``num_experts`` or ``num_local_experts``; dense are the first
    ``first_k_dense_replace``, those in ``mlp_only_layers``, and those off ``moe_layer_freq`` /
    ``decoder_sparse_step``), a router and three projections of ``moe_intermediate_size`` per
    expert and shared experts (``n_shared_experts``, ``shared_expert_intermediate_size``), two
    norms, and the final norm. Tensors are counted the same way. Not counted: biases, q/k norms,
    multi-token-prediction layers, vision towers. The dtype is ``dtype``, else the config's
    ``torch_dtype`` (or ``dtype``), else bfloat16."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
        text = dict(config["text_config"])
        for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
            if key in config and key not in text:
                text[key] = config[key]
        config = text

    def whole(key: str, default: int | None = None) -> int:
        value = config.get(key)
        value = default if value is None else value
        if value is None:
            raise ValueError(f"{source}: {key} is missing; a decoder's config.json has it")
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise ValueError(f"{source}: {key} must be a whole number >= 0, got {value!r}")
        return value

    hidden = whole("hidden_size")
    layers = whole("num_hidden_layers")
    vocab = whole("vocab_size")
    heads = whole("num_attention_heads")
    if hidden < 1 or layers < 1 or vocab < 1 or heads < 1:
        raise ValueError(
            f"{source}: hidden_size, num_hidden_layers, vocab_size and num_attention_heads must "
            "be at least 1"
        )
    kv_heads = whole("num_key_value_heads", heads) or heads
    head_dim = whole("head_dim", hidden // heads) or hidden // heads
    experts = next(
        (
            whole(k)
            for k in ("n_routed_experts", "num_experts", "num_local_experts")
            if config.get(k)
        ),
        0,
    )
    mlp = whole("intermediate_size", None if not experts else 0)

    params = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2) + hidden
    tensors = (1 if config.get("tie_word_embeddings", False) else 2) + 1
    if config.get("kv_lora_rank"):
        q_rank = whole("q_lora_rank", 0)
        kv_rank, rope = whole("kv_lora_rank"), whole("qk_rope_head_dim")
        nope, v_dim = whole("qk_nope_head_dim"), whole("v_head_dim")
        q_out = heads * (nope + rope)
        attention = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v_dim)
        attention += heads * v_dim * hidden
        attention += hidden * q_rank + q_rank + q_rank * q_out if q_rank else hidden * q_out
        attention_tensors = 4 + (3 if q_rank else 1)
    else:
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        attention_tensors = 4
    norms = 2 * hidden

    expert_mlp = whole("moe_intermediate_size", mlp) or mlp
    shared = whole("n_shared_experts", 0) * expert_mlp
    shared_gate = 0
    if not shared and config.get("shared_expert_intermediate_size"):
        shared, shared_gate = whole("shared_expert_intermediate_size"), 1
    dense_first = whole("first_k_dense_replace", 0)
    dense_listed = set(config.get("mlp_only_layers") or ())
    freq = whole("moe_layer_freq", 1) or 1
    step = whole("decoder_sparse_step", 1) or 1
    score_bias = 1 if config.get("topk_method") == "noaux_tc" else 0
    for layer in range(layers):
        params += attention + norms
        tensors += attention_tensors + 2
        sparse = (
            experts
            and layer >= dense_first
            and layer not in dense_listed
            and layer % freq == 0
            and (layer + 1) % step == 0
        )
        if sparse:
            params += experts * hidden + experts * 3 * hidden * expert_mlp
            params += 3 * hidden * shared + shared_gate * hidden + score_bias * experts
            tensors += 1 + 3 * experts + (3 if shared else 0) + shared_gate + score_bias
        else:
            params += 3 * hidden * mlp
            tensors += 3
    given = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    canonical, itemsize = dtype_bytes(str(given))
    return ModelSpec(
        params=params,
        dtype=canonical,
        tensors=tensors,
        model_bytes=params * itemsize,
        source=f"{source}: estimated from the layer structure",
        estimated=True,
    )


# -- the designs ------------------------------------------------------------------------------


class Staging(enum.Enum):
    """Where a design lands the new version before generation serves it."""

    NONE = "none"
    """In place: generation parks, the transfer writes the served tensors."""
    DEVICE = "device"
    """A second copy of each GPU's shard in device memory, installed by an HBM copy."""
    HOST = "host"
    """Each GPU's shard in host memory, installed over PCIe."""


def delta_bytes(model: ModelSpec, changed_fraction: float) -> int:
    """The encoded delta of one training step that changed ``changed_fraction`` of the served
    elements: each changed element its position as 16 bits (an offset within a block of 65,536
    elements, the blocks' own headers left out) and its new value in the served dtype. Twice
    ``changed_fraction x`` the bytes for bfloat16; no compression beyond that."""
    if not 0 < changed_fraction <= 1:
        raise ValueError(f"a changed fraction must be in (0, 1], got {changed_fraction!r}")
    changed = math.ceil(changed_fraction * model.params)
    return max(1, changed * (2 + model.bytes_per_element))


@dataclass(frozen=True)
class Design:
    """One way to sync: a topology, where the version lands, and what the model says of it."""

    topology: Topology
    staging: Staging
    delta: bool
    """Only the changed elements travel (:func:`delta_bytes`), staged in device memory and
    applied while parked (docs/delta.md)."""
    estimate: RefitEstimate
    """The cost model's refit, stall and phases (the bytes moved are the delta's for a delta
    design)."""
    bucket_buffer_bytes: int
    """Device memory of the transfer's bucket buffers on the busiest replica GPU (rule 3)."""
    staging_bytes: int
    """Device memory staging takes per replica GPU: 0 unless :attr:`staging` is DEVICE."""
    host_memory_bytes_per_gpu: int
    """Host memory staging takes per replica GPU: 0 unless :attr:`staging` is HOST."""
    fits: bool | None
    """:attr:`memory_bytes_per_gpu` is at most the free memory given; ``None``: none given."""

    @property
    def name(self) -> str:
        """``"sharded_two_hop, staged in device memory"``: the topology, then the staging."""
        if self.delta:
            return f"{self.topology.value}, delta staged in device memory"
        where = {
            Staging.NONE: "in place",
            Staging.DEVICE: "staged in device memory",
            Staging.HOST: "staged in host memory",
        }[self.staging]
        return f"{self.topology.value}, {where}"

    @property
    def implemented(self) -> bool:
        """The package runs this design today: its topology does, and, for a delta design,
        the topology moves deltas (:attr:`~rollout_sync.scale.Topology.delta_implemented`)."""
        return self.topology.implemented and (not self.delta or self.topology.delta_implemented)

    @property
    def refit_s(self) -> float:
        return self.estimate.refit_s

    @property
    def stall_s(self) -> float:
        return self.estimate.stall_s

    @property
    def memory_bytes_per_gpu(self) -> int:
        """Device memory per replica GPU beyond its served weights: buckets and staging."""
        return self.bucket_buffer_bytes + self.staging_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "implemented": self.implemented,
            "refit_s": self.refit_s,
            "stall_s": self.stall_s,
            "memory_bytes_per_gpu": self.memory_bytes_per_gpu,
            "fits": self.fits,
            "topology": self.topology.value,
            "staging": self.staging.value,
            "delta": self.delta,
            "bucket_buffer_bytes_per_gpu": self.bucket_buffer_bytes,
            "staging_bytes_per_gpu": self.staging_bytes,
            "host_memory_bytes_per_gpu": self.host_memory_bytes_per_gpu,
            "sync_bytes": self.estimate.scenario.model_bytes,
            "busiest_link_bytes": self.estimate.busiest_link_bytes,
            "phases": {p.name: p.seconds for p in self.estimate.phases},
        }


@dataclass(frozen=True)
class Plan:
    """Every design for one model on one fleet, ranked, and the one to choose."""

    model: ModelSpec
    fleet: FleetSpec
    changed_fraction: float | None
    designs: tuple[Design, ...]
    """Ranked by refit (then stall, then name)."""
    recommended: Design | None
    """Rule 5's choice; ``None`` when no implemented design fits."""
    reason: str
    """Why :attr:`recommended` (or why none), in a sentence or two."""
    speed_of_light_s: float
    """Each replica takes in the whole model through its GPUs' NICs, at their rate."""
    assumptions: tuple[tuple[str, str], ...]
    """(constant, its value and where it comes from): what the numbers rest on beyond the
    inputs."""

    @property
    def by_stall(self) -> tuple[Design, ...]:
        """The designs ranked by stall (then refit, then name)."""
        return tuple(sorted(self.designs, key=lambda d: (d.stall_s, d.refit_s, d.name)))

    def design(self, name: str) -> Design:
        """The design called ``name``; ``KeyError`` naming the plan's designs otherwise."""
        for candidate in self.designs:
            if candidate.name == name:
                return candidate
        raise KeyError(f"no design {name!r}; the plan has {[d.name for d in self.designs]}")

    def to_json(self) -> dict[str, Any]:
        m, f = self.model, self.fleet
        return {
            "designs": [d.to_json() for d in self.designs],
            "recommended": None if self.recommended is None else self.recommended.name,
            "reason": self.reason,
            "by_refit": [d.name for d in self.designs],
            "by_stall": [d.name for d in self.by_stall],
            "model": {
                "params": m.params,
                "dtype": m.dtype,
                "bytes_per_element": m.bytes_per_element,
                "model_bytes": m.model_bytes,
                "tensors": m.tensors,
                "source": m.source,
                "estimated": m.estimated,
            },
            "fleet": {
                "trainer_ranks": f.trainer_ranks,
                "replicas": f.replicas,
                "gpus_per_replica": f.gpus_per_replica,
                "nic_bytes_per_s": f.nic_bytes_per_s,
                "bucket_bytes": f.bucket_bytes,
                "free_memory_bytes": f.free_memory_bytes,
            },
            "changed_fraction": self.changed_fraction,
            "speed_of_light_s": self.speed_of_light_s,
            "assumptions": {name: text for name, text in self.assumptions},
        }


_GIVEN = {"model_bytes", "tensors", "trainer_gpus, replicas, gpus_per_replica"}
"""Sources of a base fleet's constants that a plan's inputs replace."""


def fleet_of(model: ModelSpec, spec: FleetSpec, base: Fleet = FLEET_1T) -> Fleet:
    """``base`` with the model's bytes and tensors and the fleet's shape, NIC rate and bucket;
    its NIC latency, NVLink, node size and costs kept, and the sources of those."""
    given = (
        ("model_bytes, tensors", model.source),
        ("trainer_gpus, replicas, gpus_per_replica, nic rate, bucket_bytes", "given"),
    )
    kept = tuple(
        (name, source)
        for name, source in base.sources
        if name not in _GIVEN and (name != "bucket_bytes" or spec.bucket_bytes == base.bucket_bytes)
    )
    return replace(
        base,
        name=f"{model.params:.3g} parameters, {model.dtype}: {spec.trainer_ranks} trainer ranks "
        f"-> {spec.replicas} replicas x {spec.gpus_per_replica} GPUs",
        model_bytes=model.model_bytes,
        tensors=model.tensors,
        trainer_gpus=spec.trainer_ranks,
        replicas=spec.replicas,
        gpus_per_replica=spec.gpus_per_replica,
        nic=Link(spec.nic_bytes_per_s, base.nic.latency_s),
        bucket_bytes=spec.bucket_bytes,
        sources=given + kept,
    )


def _design(
    fleet: Fleet,
    topology: Topology,
    staging: Staging,
    *,
    delta: int | None,
    free: int | None,
) -> Design:
    """One design on ``fleet``; ``delta``: the encoded delta's bytes, for a delta design."""
    scenario = fleet.scenario(staged=staging is not Staging.NONE)
    costs = fleet.costs
    if staging is Staging.DEVICE:
        costs = replace(costs, install_bytes_per_s=fleet.device_install_bytes_per_s)
    if delta is not None:
        scenario = replace(scenario, model_bytes=delta)
    result = estimate(topology, scenario, costs)
    shard = math.ceil(scenario.model_bytes / fleet.gpus_per_replica)
    sharded = topology in (Topology.SHARDED_TWO_HOP, Topology.SHARDED_PIPELINED)
    # One-source designs stream the whole model through every replica GPU; sharded, its shard.
    through = shard if sharded else scenario.model_bytes
    buffers = 2 if fleet.replicas > 1 else 1
    bucket_buffers = buffers * min(fleet.bucket_bytes, through)
    staging_bytes = shard if staging is Staging.DEVICE else 0
    host = shard if staging is Staging.HOST else 0
    fits = None if free is None else bucket_buffers + staging_bytes <= free
    return Design(
        topology, staging, delta is not None, result, bucket_buffers, staging_bytes, host, fits
    )


def build_plan(
    model: ModelSpec,
    fleet: FleetSpec,
    *,
    changed_fraction: float | None = None,
    base: Fleet = FLEET_1T,
) -> Plan:
    """Every design for ``model`` on ``fleet``, ranked, with a recommendation (the module's
    rules). ``changed_fraction``: the measured fraction of served elements one training step
    changes, in (0, 1]; it adds the delta designs. :class:`ValueError` for one outside."""
    if changed_fraction is not None and not 0 < changed_fraction <= 1:
        raise ValueError(f"changed_fraction must be in (0, 1], got {changed_fraction!r}")
    built = fleet_of(model, fleet, base)
    free = fleet.free_memory_bytes
    designs = [
        _design(built, topology, staging, delta=None, free=free)
        for topology in Topology
        for staging in Staging
    ]
    if changed_fraction is not None:
        encoded = delta_bytes(model, changed_fraction)
        designs += [
            _design(built, topology, Staging.DEVICE, delta=encoded, free=free)
            for topology in Topology
        ]
    ranked = tuple(sorted(designs, key=lambda d: (d.refit_s, d.stall_s, d.name)))
    recommended, reason = _recommend(ranked, free)
    return Plan(
        model=model,
        fleet=fleet,
        changed_fraction=changed_fraction,
        designs=ranked,
        recommended=recommended,
        reason=reason,
        speed_of_light_s=built.speed_of_light_s,
        assumptions=_assumptions(built, base, changed_fraction),
    )


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in decimal units, three figures (``62.5 GB``)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _recommend(ranked: tuple[Design, ...], free: int | None) -> tuple[Design | None, str]:
    """Rule 5, and the reason in words."""
    implemented = [d for d in ranked if d.implemented]
    fitting = [d for d in implemented if d.fits is not False]
    if not fitting:
        smallest = min(implemented, key=lambda d: d.memory_bytes_per_gpu)
        assert free is not None  # without free memory every design "fits"
        return None, (
            f"No implemented design fits in {format_bytes(free)} per GPU: the smallest, "
            f"{smallest.name}, needs {format_bytes(smallest.memory_bytes_per_gpu)} (the bucket "
            "buffers). Free some memory, or use smaller buckets."
        )
    fastest = fitting[0]
    close = [
        d
        for d in fitting
        if d.refit_s <= (1 + CLOSE_REFIT) * fastest.refit_s and d.stall_s < fastest.stall_s
    ]
    pick = min(close, key=lambda d: (d.stall_s, d.refit_s)) if close else fastest
    among = "the implemented designs" + (
        f" that fit in {format_bytes(free)} per GPU" if free is not None else ""
    )
    if pick is fastest:
        why = f"The fastest refit, {pick.refit_s:.3g} s, among {among}."
    else:
        why = (
            f"Within {CLOSE_REFIT:.0%} of the fastest refit among {among} ({fastest.name}: "
            f"{fastest.refit_s:.3g} s), at {pick.refit_s:.3g} s, for a stall of "
            f"{pick.stall_s:.3g} s instead of {fastest.stall_s:.3g} s."
        )
    if pick.staging is Staging.NONE:
        stall = f"Stall {pick.stall_s:.3g} s: generation stops for the whole transfer."
    else:
        stall = f"Stall {pick.stall_s:.3g} s: generation stops only for the park and the install."
    needs = format_bytes(pick.memory_bytes_per_gpu)
    memory = f"Needs {needs} of device memory per GPU beyond the weights"
    if pick.staging is Staging.DEVICE:
        memory += " (its shard staged, and the bucket buffers)"
    elif pick.staging is Staging.HOST:
        host = format_bytes(pick.host_memory_bytes_per_gpu)
        memory += f" (the bucket buffers) and {host} of host memory"
    else:
        memory += " (the bucket buffers)"
    memory += "." if free is not None else "; memory not checked: no free memory given."
    faster = [d for d in ranked if d.refit_s < pick.refit_s and not d.implemented]
    modelled = (
        f" Faster, modelled only: {faster[0].name}, {faster[0].refit_s:.3g} s." if faster else ""
    )
    return pick, f"{why} {stall} {memory}{modelled}"


def _assumptions(
    fleet: Fleet, base: Fleet, changed_fraction: float | None
) -> tuple[tuple[str, str], ...]:
    """What the numbers rest on: the base fleet's constants a plan keeps, each with its source,
    and the plan's own (rule 3, the delta's encoding)."""
    out: list[tuple[str, str]] = []
    for name, source in base.sources:
        if name in _GIVEN:
            continue
        if name == "nic":
            out.append(
                (
                    "nic",
                    f"{fleet.nic.rate_bytes_per_s / 1e9:.3g} GB/s per GPU (given); latency "
                    f"{fleet.nic.latency_s * 1e6:.3g} us, as the base fleet's nic ({source})",
                )
            )
        elif name == "bucket_bytes" and fleet.bucket_bytes != base.bucket_bytes:
            out.append(("bucket_bytes", f"{fleet.bucket_bytes / 2**20:.4g} MiB (given)"))
        else:
            out.append((name, source))
    out.append(
        (
            "memory per GPU",
            "beyond the served weights: bucket buffers (two on a GPU that sends, the first "
            "replica's with several replicas; one on a receiver), plus, staged in device "
            "memory, a second copy of the GPU's shard (model bytes / GPUs per replica); "
            "staged in host memory, that copy in host memory instead",
        )
    )
    if fleet.trainer_gpus > 1:
        out.append(
            (
                "gather",
                "one-source topologies: the one sending trainer rank gathers each bucket from "
                f"the {fleet.trainer_gpus} ranks' shards (NVLink within its node of "
                f"{fleet.gpus_per_node}, its NIC for the rest), overlapped by bucket",
            )
        )
    if changed_fraction is not None:
        out.append(
            (
                "delta",
                f"implemented over every topology but the pipelined sharded relay (docs/delta.md): "
                f"{changed_fraction:g} of the elements change; each a "
                "16-bit position and its value (2 x the fraction x the bytes in bf16), staged in "
                "device memory and applied while parked at the HBM copy rate (optimistic: "
                "scattered writes); the trainer's diff against the served version not counted",
            )
        )
    return tuple(out)
