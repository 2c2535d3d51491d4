"""The engine side of the vLLM backend: a worker extension that writes, checks and traces weights.

vLLM mixes ``worker_extension_cls`` into its worker class, in the engine's process, and the
frontend reaches its methods with ``collective_rpc``. :class:`RolloutSyncWorkerExtension` adds
the methods the backend in :mod:`rollout_sync.backends.vllm` calls:

* what the engine serves, as checkpoint-format specs (names, shapes, dtypes): read from the
  safetensors headers of the checkpoint the engine loaded, with the engine's dtype;
* a weight write (safetensors bytes, or a path to a safetensors file) through vLLM's in-place
  ``reload_weights`` (the default), or through a plain in-place ``copy_`` into the parameters,
  which is only right where the platform serves the parameters as they are;
* a check that the write *landed*, read back through the very kernels the forward uses;
* forward spans (forward hooks on the model) and write spans, on one clock with the frontend.

Why the read-back: vLLM for CPU repacks linear weights after loading. The parameters a module
shows become empty (``[0]``) or, for ``lm_head``, stay visible while the forward computes from
a packed copy. A ``copy_`` into them raises, or is silently ignored. So the check does not look
at parameters; it multiplies one-hot rows through each module's own ``quant_method.apply``,
which returns columns of the weight the kernel really multiplies with, exactly (one product by
1.0 and sums of zeros are exact in every float format). Parameters a forward reads as they are
(embeddings, norms, biases) are compared directly. Every comparison is bit-exact, so even the
tiny step between two RL policy versions is told apart from a write that did not land.

Under tensor parallelism every worker is handed the whole checkpoint tensors (vLLM's loader
keeps its shard) and reads back its own shard: :func:`build_probe_plan` locates it per layer.

This module is imported inside the engine, where vLLM is installed; it imports nothing from
vLLM at module level so that the frontend can name it without importing vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
import threading
import time
import zlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...errors import WriteRefused
from ...trace import SpanKind, Timeline

__all__ = [
    "WORKER_EXTENSION",
    "Probe",
    "ProbePlan",
    "RolloutSyncWorkerExtension",
    "Witness",
    "WriteRefused",
    "build_probe_plan",
    "checkpoint_specs",
    "copy_in_place",
    "decode_payload",
    "partial_load_groups",
    "probe_columns",
    "verify_witnesses",
    "verify_written",
    "witness_of",
]

WORKER_EXTENSION = "rollout_sync.backends.vllm.worker.RolloutSyncWorkerExtension"
"""The ``worker_extension_cls`` to pass to vLLM (the backend does this for you)."""

WRITE_METHODS = ("reload", "copy")

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# -- what the engine serves --------------------------------------------------------------------


def _read_safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def _checkpoint_files(model: str) -> list[Path]:
    root = Path(model)
    if not root.is_dir():
        # A hub id: the engine downloaded it into the local cache when it started.
        try:
            from huggingface_hub import snapshot_download

            root = Path(
                snapshot_download(
                    model, allow_patterns=["*.safetensors", "*.json"], local_files_only=True
                )
            )
        except Exception as exc:
            raise FileNotFoundError(
                f"{model!r} is neither a directory nor a model in the local hub cache; the "
                "rollout_sync vLLM backend reads the served weight specs from its safetensors "
                f"headers ({type(exc).__name__}: {exc})"
            ) from exc
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({root / f for f in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors checkpoint under {root}: the rollout_sync vLLM backend reads the "
            "served weight names and shapes from safetensors headers; convert the checkpoint "
            "with transformers' save_pretrained(..., safe_serialization=True)"
        )
    return files


def checkpoint_specs(
    model: str, dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint-format names and shapes of what the engine loaded, by name, in name order.

    Floating-point tensors get the engine's ``dtype`` (that is what the engine serves and what
    a write must send); other tensors keep the checkpoint's.
    """
    found: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for path in _checkpoint_files(model):
        for name, entry in _read_safetensors_header(path).items():
            stored = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if stored is None:
                raise ValueError(f"{path.name}: {name} has an unsupported dtype {entry['dtype']}")
            found[name] = (
                tuple(int(d) for d in entry["shape"]),
                dtype if stored.is_floating_point else stored,
            )
    return dict(sorted(found.items()))


# -- where each checkpoint tensor lands, and how to read it back -------------------------------


@dataclass(frozen=True)
class Probe:
    """How to read back one checkpoint tensor from the served model.

    ``kind`` is ``"op"`` for a weight the forward multiplies with through the module's
    ``quant_method.apply`` (read back by one-hot rows), ``"param"`` for a tensor the forward
    reads as it is. The tensor occupies rows ``row_offset : row_offset + rows`` of the module's
    output (a packed module such as ``qkv_proj`` stacks several checkpoint tensors).
    """

    name: str
    module: str
    param: str
    kind: str
    row_offset: int
    rows: int
    src_row: int = 0
    """The first row of the checkpoint tensor that this rank holds (tensor parallelism: its
    shard; 0 otherwise)."""
    col_start: int = 0
    """The first input column of the checkpoint tensor this rank holds (a row-parallel
    layer's shard of its input dimension)."""
    width: int = -1
    """How many input columns this rank holds from ``col_start`` (``-1``: all of them)."""

    def local_part(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of checkpoint tensor ``tensor`` this probe's rank holds (a view; the whole
        tensor without tensor parallelism)."""
        if tensor.dim() == 0:
            return tensor
        part = tensor[self.src_row : self.src_row + self.rows]
        if self.width >= 0 and part.dim() >= 2:
            part = part[:, self.col_start : self.col_start + self.width]
        return part


@dataclass
class ProbePlan:
    """For every checkpoint name: its probes, and its load group (the module it loads into)."""

    probes: dict[str, list[Probe]] = field(default_factory=dict)
    groups: dict[str, str] = field(default_factory=dict)
    unverifiable: dict[str, str] = field(default_factory=dict)


def _is_op_module(module: torch.nn.Module) -> bool:
    """A module whose weight the forward only reaches through ``quant_method.apply``."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return isinstance(module, (LinearBase, ParallelLMHead)) and hasattr(
        getattr(module, "quant_method", None), "apply"
    )


def _lora_base_layer(module: torch.nn.Module) -> torch.nn.Module | None:
    """The layer vLLM's LoRA wrapper (``BaseLayerWithLoRA``) wraps, or ``None`` for a module
    that is not one (no LoRA, or vLLM not imported)."""
    lora_layers = sys.modules.get("vllm.lora.layers")
    wrapper = getattr(lora_layers, "BaseLayerWithLoRA", None)
    if wrapper is None or not isinstance(module, wrapper):
        return None
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, torch.nn.Module) else None


def build_probe_plan(
    model: torch.nn.Module,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> ProbePlan:
    """Map every checkpoint tensor to the served module rows it loads into, on tensor-parallel
    rank ``tp_rank`` of ``tp_size``.

    Uses the model's own ``packed_modules_mapping`` (``q_proj`` -> ``qkv_proj`` shard 0, ...)
    and ``hf_to_vllm_mapper`` where it has one. With tensor parallelism each probe reads back
    this rank's shard only, located as vLLM's weight loaders cut it (:func:`_tp_shard`). A name
    that maps nowhere, or onto a layer whose split this read-back does not know, is listed in
    ``unverifiable`` with the reason.
    """
    plan = ProbePlan()
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    claimed: set[str] = set()
    for name, (shape, _dtype) in specs.items():
        mapped = name
        if mapper is not None:
            renamed = mapper.map_name(name)
            if renamed is None:
                plan.unverifiable[name] = "the model ignores it when loading"
                continue
            mapped = renamed
        module_path, _, param = mapped.rpartition(".")
        parent = module_path.rpartition(".")[0]
        # The packing is read off the checkpoint name: a mapper may already have renamed
        # q_proj to qkv_proj (vLLM's "stacked" mapping), which loses the shard.
        leaf = name.rpartition(".")[0].rpartition(".")[2]
        target, offset, part = module_path, 0, -1
        for packed_name, parts in packed.items():
            if leaf in parts and leaf != packed_name:
                target = f"{parent}.{packed_name}" if parent else packed_name
                part = parts.index(leaf)
                for sibling in parts[:part]:
                    sibling_name = name.replace(f".{leaf}.", f".{sibling}.")
                    sibling_spec = specs.get(sibling_name)
                    if sibling_spec is None:
                        offset = -1
                        break
                    offset += sibling_spec[0][0]
                break
        if offset < 0:
            plan.unverifiable[name] = (
                f"a part packed with it into {target} is not in the checkpoint"
            )
            continue
        try:
            module = model.get_submodule(target)
        except AttributeError:
            plan.unverifiable[name] = f"no served module {target!r}"
            continue
        base = _lora_base_layer(module)
        if base is not None:
            # With LoRA on, vLLM wraps the layer; the base weight lives in the wrapped one.
            target, module = f"{target}.base_layer", base
        rows = shape[0] if shape else 1
        kind = "op" if param == "weight" and len(shape) == 2 and _is_op_module(module) else "param"
        probe = Probe(name, target, param, kind, offset, rows)
        if tp_size > 1:
            sharded = _tp_shard(module, param, part, shape, tp_rank, tp_size, kind)
            if isinstance(sharded, str):
                plan.unverifiable[name] = f"{target}.{param}: {sharded}"
                continue
            probe = Probe(
                name,
                target,
                param,
                kind,
                sharded.get("row_offset", offset),
                sharded.get("rows", rows),
                sharded.get("src_row", 0),
                sharded.get("col_start", 0),
                sharded.get("width", -1),
            )
        if kind == "param":
            local_shape = _local_shape(probe, shape)
            if not _holds_rows(getattr(module, param, None), local_shape, probe.row_offset):
                plan.unverifiable[name] = f"{target}.{param} is not served as a plain tensor"
                continue
        plan.probes[name] = [probe]
        plan.groups[name] = target
        claimed.add(target)
    _add_tied_lm_head(model, plan, claimed, tp_size)
    return plan


def _local_shape(probe: Probe, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the part of a checkpoint tensor of ``shape`` that ``probe`` reads back."""
    if not shape:
        return ()
    rest = list(shape[1:])
    if probe.width >= 0 and rest:
        rest[0] = probe.width
    return (probe.rows, *rest)


_TP_LAYERS = (
    "QKVParallelLinear",
    "MergedColumnParallelLinear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ReplicatedLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
)
"""The layers whose tensor-parallel split :func:`_tp_shard` knows (by exact class: a subclass
may cut its weight otherwise, e.g. a fused QKV with an indexer)."""


def _tp_shard(
    module: torch.nn.Module,
    param: str,
    part: int,
    shape: Sequence[int],
    tp_rank: int,
    tp_size: int,
    kind: str,
) -> dict[str, int] | str:
    """Where a checkpoint tensor of ``shape`` (``param`` of ``module``; ``part``: its index in
    a packed module, ``-1`` if not packed) lands on tensor-parallel rank ``tp_rank``: the
    :class:`Probe` fields ``row_offset``, ``src_row``, ``rows``, ``col_start``, ``width``, as
    vLLM's weight loaders cut it (``vllm/model_executor/parameter.py``:
    ``load_column_parallel_weight``, ``load_merged_column_weight``, ``load_qkv_weight``,
    ``load_row_parallel_weight``; ``VocabParallelEmbedding.weight_loader``). A string says why
    it cannot be located."""
    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    layer = type(module)
    known = {getattr(linear, n, None) for n in _TP_LAYERS[:5]} | {
        getattr(vocab_parallel_embedding, n, None) for n in _TP_LAYERS[5:]
    }
    if layer not in known:
        if kind == "op":
            return (
                f"a tensor-parallel layer of type {layer.__name__} (the read-back knows how "
                f"{', '.join(_TP_LAYERS)} split their weights)"
            )
        return {}  # a plain parameter (a norm): every rank holds it whole; checked by shape
    rows = int(shape[0]) if shape else 1
    # vLLM's loaders cut by the layer's own split (a layer may opt out of tensor parallelism).
    rank = int(getattr(module, "tp_rank", tp_rank))
    size_of_split = int(getattr(module, "tp_size", tp_size))
    name = layer.__name__
    whole = name == "ReplicatedLinear" or (name == "RowParallelLinear" and param != "weight")
    if whole or (size_of_split == 1 and name not in _TP_LAYERS[5:]):
        return {}  # whole on every rank (a row-parallel bias is added once, after the reduce)
    if param not in ("weight", "bias"):
        return f"{name} parameter {param!r} (the read-back knows weight and bias)"
    if name == "RowParallelLinear":
        width = int(getattr(module, "input_size_per_partition"))  # noqa: B009
        return {"col_start": rank * width, "width": width}
    if name in ("VocabParallelEmbedding", "ParallelLMHead"):
        indices = getattr(module, "shard_indices")  # noqa: B009
        start = int(indices.org_vocab_start_index)
        return {
            "row_offset": 0,
            "src_row": start,
            "rows": int(indices.org_vocab_end_index) - start,
        }
    if name == "QKVParallelLinear":
        if part < 0 or part > 2:
            return "a QKV projection not loaded as separate q, k and v parts"
        shard_id = "qkv"[part]
        qkv: Any = module
        offset = int(qkv._get_shard_offset_mapping(shard_id))
        size = int(qkv._get_shard_size_mapping(shard_id))
        replicas = 1 if shard_id == "q" else int(getattr(module, "num_kv_head_replicas", 1))
        return {"row_offset": offset, "src_row": (rank // replicas) * size, "rows": size}
    if name == "MergedColumnParallelLinear":
        sizes = [int(n) for n in getattr(module, "output_sizes")]  # noqa: B009
        if part < 0 or part >= len(sizes):
            return "a merged projection not loaded as its separate parts"
        size = sizes[part] // size_of_split
        return {
            "row_offset": sum(sizes[:part]) // size_of_split,
            "src_row": rank * size,
            "rows": size,
        }
    # ColumnParallelLinear
    if part >= 0:
        return "a packed column-parallel layer of an unknown kind"
    size = int(getattr(module, "output_size_per_partition"))  # noqa: B009
    if rows < (rank + 1) * size:
        return f"{rows} rows hold no part {rank} of {size} rows"
    return {"row_offset": 0, "src_row": rank * size, "rows": size}


def partial_load_groups(names: Collection[str], groups: Mapping[str, str]) -> list[str]:
    """One line per load group (a fused module: ``qkv_proj``) that ``names`` touch without
    naming all of its parts; ``groups`` maps each checkpoint name to its group
    (:attr:`ProbePlan.groups`). vLLM rebuilds a fused module from all of its parts, so a part
    sent alone leaves the others uninitialized."""
    members: dict[str, list[str]] = {}
    for name, group in groups.items():
        members.setdefault(group, []).append(name)
    sent = set(names)
    problems = []
    for group in sorted({groups[n] for n in sent if n in groups}):
        missing = [n for n in members[group] if n not in sent]
        if missing:
            problems.append(
                f"{group}: a fused module must be sent whole; missing {', '.join(missing)}"
            )
    return problems


def _holds_rows(served: object, local_shape: Sequence[int], row_offset: int) -> bool:
    """Whether ``served`` is a plain tensor with rows ``row_offset : row_offset + rows`` of a
    tensor of ``local_shape`` (``rows`` its first dimension; not repacked by the platform into
    another layout, or to nothing)."""
    rows = local_shape[0] if local_shape else 1
    return (
        isinstance(served, torch.Tensor)
        and served.numel() > 0
        and tuple(served.shape[1:]) == tuple(local_shape[1:])
        and served.shape[0] >= row_offset + rows
    )


def _add_tied_lm_head(
    model: torch.nn.Module, plan: ProbePlan, claimed: set[str], tp_size: int = 1
) -> None:
    """A tied ``lm_head`` loads from the embedding's checkpoint tensor: probe it there too."""
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or "lm_head" in claimed or not _is_op_module(lm_head):
        return
    for name, probes in plan.probes.items():
        first = probes[0]
        if first.param == "weight" and first.module.endswith("embed_tokens"):
            probe = Probe(name, "lm_head", "weight", "op", 0, first.rows)
            if tp_size > 1:
                indices = getattr(lm_head, "shard_indices")  # noqa: B009
                start = int(indices.org_vocab_start_index)
                probe = dataclasses.replace(
                    probe, src_row=start, rows=int(indices.org_vocab_end_index) - start
                )
            probes.append(probe)
            return


# -- writing and checking ----------------------------------------------------------------------


def decode_payload(payload: bytes | str) -> dict[str, torch.Tensor]:
    """Safetensors bytes, or the path of a safetensors file, to a name -> tensor dict."""
    import safetensors.torch

    if isinstance(payload, (bytes, bytearray, memoryview)):
        return dict(safetensors.torch.load(bytes(payload)))
    return dict(safetensors.torch.load_file(payload))


def copy_in_place(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], plan: ProbePlan
) -> None:
    """Write by ``param.data[rows].copy_``: right only where parameters are what the forward reads.

    Checks every target first and raises :class:`WriteRefused` (a
    :class:`~rollout_sync.errors.WeightMismatchError`: nothing written) if any
    parameter is not there to be written, e.g. repacked to an empty tensor. It cannot see a
    parameter that stays visible while the forward reads a packed copy (``lm_head`` on the CPU
    build): only the read-back after the write can.
    """
    targets: list[tuple[torch.Tensor, Probe, torch.Tensor]] = []
    problems: list[str] = []
    for name, tensor in tensors.items():
        probe = plan.probes[name][0]
        served = getattr(model.get_submodule(probe.module), probe.param)
        part = probe.local_part(tensor)
        if not _holds_rows(served, _local_shape(probe, tensor.shape), probe.row_offset):
            problems.append(
                f"{name}: {probe.module}.{probe.param} is served with shape "
                f"{list(served.shape)} (repacked by the platform), not writable in place"
            )
            continue
        targets.append((served, probe, part))
    if problems:
        raise WriteRefused(
            problems,
            context="weights copied in place",
            advice="The platform repacked these parameters: write with write_method='reload'.",
        )
    with torch.no_grad():
        for served, probe, part in targets:
            served.data[probe.row_offset : probe.row_offset + probe.rows].copy_(part)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:
        a = a.to(b.dtype)
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


@dataclass(frozen=True)
class Witness:
    """What the read-back compares one checkpoint tensor with, kept instead of the tensor.

    A receiver that loads tensors as they arrive (vLLM's native weight transfer) cannot keep
    the whole model to compare after the load; it keeps this: for each ``"op"`` probe the
    sampled input columns and the tensor's values there (``rows x columns``), for each
    ``"param"`` probe a checksum of the tensor's bytes. Under tensor parallelism both are of
    the part of the tensor this worker holds (:meth:`Probe.local_part`).
    """

    name: str
    width: int
    """The input width its ``"op"`` probes read back (the tensor's second dimension, or this
    rank's part of it under tensor parallelism; 0 for a 1-D tensor)."""
    op_columns: tuple[tuple[Probe, torch.Tensor, torch.Tensor], ...]
    """``(probe, columns, tensor[:, columns])`` per ``"op"`` probe."""
    param_checksums: tuple[tuple[Probe, tuple[int, int]], ...]


def probe_columns(module: str, width: int, columns: int, seed: int) -> torch.Tensor:
    """The sorted input columns read back from ``module``: ``columns`` of ``width`` (all when
    narrower), a function of the module's name and ``seed`` only, so a witness taken when a
    tensor arrives and the read-back after the load agree."""
    count = min(columns, width)
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(module.encode())) % 2**63
    )
    return torch.randperm(width, generator=generator)[:count].sort().values


def _bytes_checksum(tensor: torch.Tensor) -> tuple[int, int]:
    from ...transfer import bucket_checksum

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    first, second = (int(x) for x in bucket_checksum(flat).tolist())
    return first, second


@torch.no_grad()
def witness_of(
    name: str, tensor: torch.Tensor, plan: ProbePlan, *, columns: int, seed: int
) -> Witness:
    """The witness of checkpoint tensor ``name`` (``tensor``), for :func:`verify_witnesses`."""
    ops: list[tuple[Probe, torch.Tensor, torch.Tensor]] = []
    params: list[tuple[Probe, tuple[int, int]]] = []
    width = int(tensor.shape[1]) if tensor.dim() == 2 else 0
    for probe in plan.probes[name]:
        part = probe.local_part(tensor)  # this rank's shard (all of it without parallelism)
        if probe.kind == "op":
            width = int(part.shape[1])
            cols = probe_columns(probe.module, width, columns, seed)
            # index_select copies the columns (2-3x faster than advanced indexing + clone).
            ops.append((probe, cols, part.index_select(1, cols.to(tensor.device))))
        else:
            params.append((probe, _bytes_checksum(part)))
    return Witness(name, width, tuple(ops), tuple(params))


@torch.no_grad()
def verify_witnesses(model: torch.nn.Module, witnesses: Sequence[Witness]) -> list[str]:
    """Every way the served model differs from what the ``witnesses`` saw; empty when the
    load landed.

    ``"op"`` probes multiply one-hot rows of the witnessed columns through the module's
    ``quant_method.apply``: the result is those columns of the weight the kernel uses,
    bit-exact. ``"param"`` probes compare a checksum of the served rows' bytes.
    """
    problems: list[str] = []
    by_module: dict[str, list[tuple[Probe, torch.Tensor, torch.Tensor]]] = {}
    widths: dict[str, int] = {}
    for witness in witnesses:
        for probe, cols, values in witness.op_columns:
            by_module.setdefault(probe.module, []).append((probe, cols, values))
            widths[probe.module] = witness.width
        for probe, checksum in witness.param_checksums:
            served = getattr(model.get_submodule(probe.module), probe.param)
            got = served.data[probe.row_offset : probe.row_offset + probe.rows]
            if _bytes_checksum(got) != checksum:
                problems.append(
                    f"{probe.name}: served {probe.module}.{probe.param} differs from what was "
                    "written"
                )
    for module_name, entries in by_module.items():
        module = model.get_submodule(module_name)
        cols = entries[0][1]
        in_width = widths[module_name]
        dtype = entries[0][2].dtype
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        count = cols.numel()
        one_hot = torch.zeros(count, in_width, dtype=dtype, device=device)
        one_hot[torch.arange(count), cols.to(device)] = 1
        quant_method: Any = getattr(module, "quant_method")  # noqa: B009 - typed as Any
        out: torch.Tensor = quant_method.apply(module, one_hot)
        for probe, _cols, values in entries:
            got = out[:, probe.row_offset : probe.row_offset + probe.rows]
            want = values.T.to(got.device)
            if not _same(got, want):
                problems.append(
                    f"{probe.name}: the kernel of {module_name} still computes with other weights "
                    f"(read back {count} of {in_width} input columns; max |diff| "
                    f"{(got.float() - want.float()).abs().max().item():.3g})"
                )
    return problems


def verify_written(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    plan: ProbePlan,
    *,
    columns: int,
    generator: torch.Generator,
) -> list[str]:
    """Every way the served model differs from ``tensors``; empty when the write landed.

    :func:`witness_of` every tensor (``columns`` input columns per module, chosen with
    ``generator``), then :func:`verify_witnesses`.
    """
    seed = int(torch.randint(2**31, (1,), generator=generator).item())
    witnesses = [
        witness_of(name, tensor, plan, columns=columns, seed=seed)
        for name, tensor in tensors.items()
    ]
    return verify_witnesses(model, witnesses)


# -- the extension -----------------------------------------------------------------------------


def tensor_parallel_position() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the engine's tensor-parallel size (vLLM's)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())


@dataclass
class _EngineState:
    plan: ProbePlan
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    timeline: Timeline = field(default_factory=Timeline)
    hooks: list[Any] = field(default_factory=list)
    forwards: int = 0
    writes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class RolloutSyncWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); called through ``collective_rpc``.

    Every method is prefixed ``rollout_sync_`` so it cannot collide with the worker's own.
    Arguments and results are plain data (bytes, str, numbers, lists, dicts): in multiprocess
    mode they cross a process boundary, where tensors do not survive.
    """

    model_runner: Any
    model_config: Any
    reload_weights: Any

    def _rollout_sync_state(self) -> _EngineState:
        state: _EngineState | None = getattr(self, "_rollout_sync_engine_state", None)
        if state is None:
            specs = checkpoint_specs(str(self.model_config.model), self.model_config.dtype)
            tp_rank, tp_size = tensor_parallel_position()
            plan = build_probe_plan(
                self.model_runner.get_model(), specs, tp_rank=tp_rank, tp_size=tp_size
            )
            state = _EngineState(plan=plan, specs=specs)
            self._rollout_sync_engine_state = state
        return state

    def rollout_sync_describe(self) -> dict[str, Any]:
        """The served weights as checkpoint specs, their load groups, what this worker cannot
        check, and its place in the engine's parallelism. A failure comes back as data
        (``{"error": ...}``), not raised: see :meth:`rollout_sync_write`."""
        from vllm.distributed import get_pp_group

        try:
            state = self._rollout_sync_state()
            tp_rank, tp_size = tensor_parallel_position()
            return {
                "specs": [
                    [name, list(shape), str(dtype).removeprefix("torch.")]
                    for name, (shape, dtype) in state.specs.items()
                ],
                "groups": dict(state.plan.groups),
                "unverifiable": dict(state.plan.unverifiable),
                "tensor_parallel_size": tp_size,
                "tensor_parallel_rank": tp_rank,
                "pipeline_parallel_size": int(get_pp_group().world_size),
            }
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def rollout_sync_write(
        self,
        payload: bytes | str,
        method: str = "reload",
        verify_columns: int = 16,
        probe_seed: int = 0,
    ) -> dict[str, Any]:
        """Write the weights in ``payload``, then read them back through the forward's kernels.

        Returns ``{"written": bool, "refused": [...], "problems": [...], "write_ms", ...}``.
        ``refused`` means nothing was written; ``problems`` lists tensors whose write did not
        land; ``error`` (when present) is an exception from the engine's loader (the write may
        be partial). Under tensor parallelism every worker writes the whole tensors (vLLM's
        loader keeps its shard) and reads back its own shard.

        Errors come back as data, never raised: with several workers, vLLM's multiprocess
        executor stops reading the other workers' answers when one raises (vLLM issue
        #49972), and every later all-worker call would get stale answers.
        """
        if method not in WRITE_METHODS:
            return {
                "written": False,
                "refused": [f"unknown write method {method!r}"],
                "problems": [],
            }
        state = self._rollout_sync_state()
        tensors = decode_payload(payload)
        unknown = [n for n in tensors if n not in state.plan.probes]
        if unknown:
            return {
                "written": False,
                "problems": [],
                "refused": [f"{n}: not a verifiable served weight" for n in unknown],
            }
        model = self.model_runner.get_model()
        state.writes += 1
        start = time.monotonic_ns()
        try:
            if method == "reload":
                self.reload_weights(
                    weights_iterator=iter(tensors.items()), is_checkpoint_format=True
                )
            else:
                copy_in_place(model, tensors, state.plan)
        except WriteRefused as refused:
            return {"written": False, "refused": refused.problems, "problems": []}
        except Exception as exc:  # as data: see the docstring
            return {
                "written": True,
                "refused": [],
                "problems": [],
                "error": f"the engine's loader raised {type(exc).__name__}: {exc}",
            }
        finally:
            if state.hooks:
                state.timeline.add_span(
                    SpanKind.WEIGHT_WRITE,
                    f"weight write #{state.writes}",
                    start,
                    method=method,
                    tensors=len(tensors),
                )
        written = time.monotonic_ns()
        generator = torch.Generator().manual_seed(probe_seed)
        problems = verify_written(
            model, tensors, state.plan, columns=verify_columns, generator=generator
        )
        return {
            "written": True,
            "refused": [],
            "problems": problems,
            "tensors": len(tensors),
            "write_ms": (written - start) / 1e6,
            "verify_ms": (time.monotonic_ns() - written) / 1e6,
        }

    # -- LoRA adapters from memory (rollout_sync.backends.vllm.lora) ----------------------------

    def _rollout_sync_lora(self) -> Any:
        from .lora import WorkerLoRAState

        state: WorkerLoRAState | None = getattr(self, "_rollout_sync_lora_state", None)
        if state is None:
            state = WorkerLoRAState()
            self._rollout_sync_lora_state = state
        return state

    def rollout_sync_lora_describe(self) -> dict[str, Any]:
        """The engine's LoRA settings, lora dtype and adaptable modules' ``(in, out)`` by
        checkpoint module path (``{"error": ...}`` as data on failure). From here on every
        adapter installed from memory is installed again after vLLM drops them all (a base
        weight write)."""
        from .lora import describe_lora

        try:
            return describe_lora(self, self._rollout_sync_lora())
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def rollout_sync_lora_install(
        self, lora_id: int, name: str, data: dict[str, Any]
    ) -> dict[str, Any]:
        """Install adapter ``name`` (vLLM id ``lora_id``) from ``data``
        (:func:`~rollout_sync.backends.vllm.lora.encode_adapter`) in place of the one of that
        id, and read its slot back. The report as data, never raised (see
        :meth:`rollout_sync_write`): ``refused`` (nothing changed), ``error`` or ``problems``
        (the adapter is not served as sent)."""
        from .lora import decode_adapter, timed_install

        try:
            adapter = decode_adapter(lora_id, name, data)
        except Exception as exc:
            return {"installed": False, "refused": [f"{type(exc).__name__}: {exc}"], "problems": []}
        state = self._rollout_sync_state()
        start = time.monotonic_ns()
        try:
            return timed_install(self, self._rollout_sync_lora(), adapter)
        finally:
            if state.hooks:
                state.timeline.add_span(
                    SpanKind.WEIGHT_WRITE, f"adapter install {name}", start, adapter=name
                )

    def rollout_sync_lora_read(self, lora_id: int) -> bytes | dict[str, Any]:
        """The slot of adapter ``lora_id`` as the forward reads it (safetensors bytes:
        ``<module>.lora_A`` ``[max_rank, in]``, ``<module>.lora_B`` ``[out, max_rank]`` with
        ``B`` scaled by ``alpha / rank``), or ``{"error": ...}``."""
        import safetensors.torch

        from .lora import read_slot

        try:
            return bytes(safetensors.torch.save(read_slot(self, int(lora_id))))
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def rollout_sync_lora_state(self) -> dict[str, Any]:
        """``{"served": [ids], "lost": {name: why}}``: the adapters installed from memory, and
        those that could not be installed again after vLLM dropped them (a base weight
        write)."""
        state = self._rollout_sync_lora()
        return {"served": sorted(state.adapters), "lost": dict(state.lost)}

    def rollout_sync_trace(self, enabled: bool = True) -> bool:
        """Record a ``forward`` span per model forward (and per logits computation)."""
        state = self._rollout_sync_state()
        for handle in state.hooks:
            handle.remove()
        state.hooks.clear()
        if not enabled:
            self._rollout_sync_attach_engine_timeline()
            return False
        model = self.model_runner.get_model()
        modules: list[tuple[str, torch.nn.Module]] = [("forward", model)]
        logits = getattr(model, "logits_processor", None)
        if isinstance(logits, torch.nn.Module):
            modules.append(("logits", logits))
        started: dict[int, int] = {}

        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            started[id(module)] = time.monotonic_ns()

        def make_post_hook(label: str) -> Any:
            def post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
                start = started.pop(id(module), None)
                if start is not None:
                    with state.lock:
                        state.forwards += 1
                    state.timeline.add_span(SpanKind.FORWARD, label, start, writes=state.writes)

            return post_hook

        for label, module in modules:
            state.hooks.append(module.register_forward_pre_hook(pre_hook))
            state.hooks.append(module.register_forward_hook(make_post_hook(label)))
        self._rollout_sync_attach_engine_timeline()
        return True

    def _rollout_sync_attach_engine_timeline(self) -> None:
        """Let a ``"rollout_sync"`` weight-transfer engine record its loads on this timeline
        (while tracing is on)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and hasattr(engine, "timeline"):
            state = self._rollout_sync_state()
            engine.timeline = state.timeline if state.hooks else None

    def rollout_sync_spans(self, clear: bool = True) -> list[dict[str, Any]]:
        """The spans recorded since the last collection (``Timeline.to_records`` form)."""
        state = self._rollout_sync_state()
        records = state.timeline.to_records()
        if clear:
            state.timeline = Timeline()
            self._rollout_sync_attach_engine_timeline()
        return records

    def rollout_sync_forward_count(self) -> int:
        """Forwards traced so far (counts also spans already collected)."""
        return self._rollout_sync_state().forwards

    def rollout_sync_close_update(self) -> str | None:
        """Close vLLM's weight-update session in this worker if it is still open; ``None`` when
        none was, else what closing did. Never raises.

        With several workers, an update that failed in some of them leaves it open in the
        others (vLLM's worker closes it only where ``update_weights`` raised), and their next
        ``start_weight_update`` would raise. A ``finish_weight_update`` to all would raise in
        the closed ones instead, and an all-worker call that raises in one worker leaves
        vLLM's executor out of step (vLLM issue #49972). This call closes each worker's
        session where it is open and reports as data.

        A staged receive still open is discarded first, never installed: closing gives an
        update up, and the served weights stay as they were."""
        engine = getattr(self, "weight_transfer_engine", None)
        discard = getattr(engine, "discard_staged", None)
        discarded = bool(discard()) if callable(discard) else False
        if not getattr(self, "_weight_update_active", False):
            return "discarded a staged receive" if discarded else None
        finish = getattr(self, "finish_weight_update", None)
        try:
            if callable(finish):
                finish()
                return "closed"
            raise RuntimeError("the worker has no finish_weight_update")
        except Exception as exc:
            self._weight_update_active = False
            reset = getattr(engine, "reset_weight_update_target", None)
            if callable(reset):
                try:
                    reset()
                except Exception:  # closing is best effort; the session is closed either way
                    pass
            return f"closed after finish_weight_update raised {type(exc).__name__}: {exc}"

    def rollout_sync_native_state(self, token: str | None = None) -> dict[str, Any] | None:
        """The ``"rollout_sync"`` weight-transfer engine's state (torn or not, updates landed,
        the last transfer), or ``None`` when the engine runs another weight-transfer backend
        or none.

        ``token`` comes back in the state (``"token"``), so that the caller can tell this
        call's answer from a stale one (vLLM issue #49972: after one worker failed an
        all-worker call, the others' answers to it are read by the next call)."""
        engine = getattr(self, "weight_transfer_engine", None)
        state = getattr(engine, "state", None)
        if not callable(state):
            return None
        answer: dict[str, Any] = state()
        answer["token"] = token
        return answer


if "vllm" in sys.modules:
    # Imported by vLLM inside a worker (as the worker extension): make the "rollout_sync"
    # weight-transfer engines available there even where the entry point is not visible.
    from .plugin import register_engines

    register_engines()
