"""LoRA adapters on vLLM, written from memory: the host side's bookkeeping and the engine side's
install and read-back.

vLLM loads an adapter only from a directory (``LoRARequest(name, id, path)``; its
``load_inplace=True`` re-reads the directory). A trainer's adapter is in memory, so the
engine side repeats vLLM's own in-place steps from tensors instead, inside one
``collective_rpc`` (which the engine runs between two steps: no forward overlaps it):

1. build a ``LoRAModel`` with ``LoRAModel.from_lora_tensors`` from copies of the tensors, under
   their PEFT names (``base_model.model.<module>.lora_A.weight``), with a ``PEFTHelper`` of the
   adapter's rank, alpha and target modules, and check it as vLLM checks an adapter read from
   disk (``validate_legal``: rank, features);
2. only then touch the engine: ``remove_adapter(id)``; ``add_adapter`` (which packs
   ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` and folds
   ``alpha / rank`` into ``B``); ``activate_adapter(id)`` (the first free slot);
   keep it in vLLM's host cache (pinned there: an adapter written from memory must never be
   evicted, there is no path to read it again from), re-pin a slot that was pinned;
3. read the slot back: every slice of every LoRA layer (``lora_a_stacked[s][slot, 0]``,
   ``lora_b_stacked[s][slot, 0]``) must equal, bit for bit, ``A`` and ``B * alpha / rank``
   where the adapter targets that slice, and zeros elsewhere.

vLLM drops every adapter whenever base weights are replaced (``reset_lora_state`` after
``reload_weights`` and ``finish_weight_update``). The engine side keeps a copy of each
adapter's tensors and installs them again right after, in the same engine call
(:func:`keep_adapters_across_weight_writes`).

Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ...lora import ALPHA_KEY, LoRAConfig, adapter_specs, iter_modules
from .generations import VersionHistory

__all__ = [
    "ADAPTER_PATH_SCHEME",
    "AdapterTable",
    "ServedAdapter",
    "adapter_slot_matches",
    "expected_slot",
    "peft_tensors",
    "save_peft_adapter",
    "vllm_lora_shapes",
]

ADAPTER_PATH_SCHEME = "rollout-sync-adapter://"
"""The ``lora_path`` of requests on an adapter written from memory: not a directory (vLLM never
reads it while the adapter is in its cache); it carries the adapter's install count, so that
vLLM's prefix cache, which hashes ``(name, path)``, never reuses a block of another install."""

_LLAMA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")


def vllm_lora_shapes(
    model: str | os.PathLike[str] | Mapping[str, Any],
) -> dict[str, tuple[int, int]]:
    """The ``(in_features, out_features)`` of every linear layer vLLM can put a LoRA adapter
    on, by Hugging Face module path (``"model.layers.0.self_attn.q_proj"``), for a Llama-family
    decoder (Llama, Mistral, Qwen2, ...: ``self_attn.{q,k,v,o}_proj`` and
    ``mlp.{gate,up,down}_proj`` per layer). ``model`` is a model directory (its
    ``config.json``) or that config as a mapping.

    What a started engine reports (:meth:`~rollout_sync.backends.vllm.VLLMAsyncBackend.lora_shapes`)
    is authoritative; this is the same answer before the engine starts.

    Raises:
        ValueError: the config lacks a field of that layout (not a Llama-family decoder).
    """
    if isinstance(model, Mapping):
        config = dict(model)
    else:
        path = Path(model) / "config.json"
        config = json.loads(path.read_text())
    try:
        hidden = int(config["hidden_size"])
        inter = int(config["intermediate_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"vllm_lora_shapes: the config lacks {exc} of a Llama-family decoder; ask a started "
            "engine instead (backend.lora_shapes())"
        ) from exc
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    return {
        f"model.layers.{i}.{leaf}": shape
        for i in range(layers)
        for leaf, shape in per_layer.items()
    }


def peft_tensors(
    config: LoRAConfig, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``tensors`` (an adapter set, names as :func:`~rollout_sync.lora.adapter_specs` gives
    them) under PEFT's names: ``base_model.model.<module>.lora_A.weight`` ``[rank, in]`` and
    ``.lora_B.weight`` ``[out, rank]``; ``lora_alpha`` is not a tensor there (it goes in
    ``adapter_config.json``)."""
    out: dict[str, torch.Tensor] = {}
    for module, a, b in iter_modules(config):
        out[f"base_model.model.{module}.lora_A.weight"] = tensors[a]
        out[f"base_model.model.{module}.lora_B.weight"] = tensors[b]
    return out


def peft_config(config: LoRAConfig, alpha: float) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``config`` with ``alpha``."""
    leaves = sorted({m.rpartition(".")[2] for m in config.target_modules})
    return {
        "r": config.rank,
        "lora_alpha": alpha,
        "target_modules": leaves,
        "bias": "none",
        "peft_type": "LORA",
    }


def save_peft_adapter(
    directory: str | os.PathLike[str], config: LoRAConfig, tensors: Mapping[str, torch.Tensor]
) -> Path:
    """Write an adapter set as a PEFT directory (``adapter_config.json`` and
    ``adapter_model.safetensors``), the form vLLM's own ``add_lora`` / ``LoRARequest`` reads;
    returns the directory. For comparisons with vLLM's disk path; the backends never need it."""
    import safetensors.torch

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    alpha = float(tensors[ALPHA_KEY]) if ALPHA_KEY in tensors else config.alpha
    (root / "adapter_config.json").write_text(json.dumps(peft_config(config, alpha)))
    safetensors.torch.save_file(
        {n: t.detach().contiguous().cpu() for n, t in peft_tensors(config, tensors).items()},
        str(root / "adapter_model.safetensors"),
    )
    return root


def expected_slot(
    config: LoRAConfig, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What vLLM's slot holds once ``tensors`` are installed: each module's ``lora_A`` as it is
    and ``lora_B`` times ``alpha / rank``, computed as vLLM computes it (a Python float, an
    in-place multiply in the tensor's dtype), so that a read-back compares bit for bit."""
    scaling = float(tensors[ALPHA_KEY]) / config.rank
    out: dict[str, torch.Tensor] = {}
    for _module, a, b in iter_modules(config):
        out[a] = tensors[a].detach().cpu().clone()
        scaled = tensors[b].detach().cpu().clone()
        if scaling != 1:
            scaled *= scaling
        out[b] = scaled
    return out


class AdapterSlotReader(Protocol):
    """What :func:`adapter_slot_matches` reads: a vLLM backend serving adapters."""

    def adapter_config(self, name: str) -> LoRAConfig: ...

    def read_adapter_slot(self, name: str) -> dict[str, torch.Tensor]: ...


def adapter_slot_matches(
    backend: AdapterSlotReader, name: str, tensors: Mapping[str, torch.Tensor]
) -> bool:
    """Whether the vLLM slot of adapter ``name`` holds ``tensors`` (a whole adapter set, names
    as :func:`~rollout_sync.lora.adapter_specs` gives them, any device) bit for bit:
    ``backend.read_adapter_slot(name)`` equals :func:`expected_slot` of the adapter's config
    and ``tensors``, the same names, shapes, dtypes and values. One engine call.

    Raises:
        KeyError: no adapter ``name`` (or ``tensors`` lacks a tensor of its config).
    """
    slot = backend.read_adapter_slot(name)
    want = expected_slot(backend.adapter_config(name), tensors)
    return slot.keys() == want.keys() and all(
        slot[k].dtype == want[k].dtype and torch.equal(slot[k], want[k]) for k in want
    )


# -- the host side: which adapters a backend serves --------------------------------------------


@dataclass
class ServedAdapter:
    """One adapter a backend serves. Invariants: ``tensors`` hold the set the engine serves
    (the last one that landed, zeros before); ``version`` is the last committed version;
    ``installs`` counts sets handed to the engine (each gives requests a new ``lora_path``)."""

    name: str
    lora_id: int
    """vLLM's ``lora_int_id`` (>= 1, never reused by this backend)."""
    config: LoRAConfig
    tensors: dict[str, torch.Tensor]
    version: int = 0
    installs: int = 0
    in_engine: bool = False
    """Whether the engine holds it (created at start, or when added to a started engine)."""
    history: VersionHistory = field(default_factory=VersionHistory)
    torn: str | None = None
    """Why requests on it are refused (``None``: servable): an install of it failed part-way,
    or the engine lost it when a base weight write dropped every adapter. Only a set of its
    own that lands clears it; a weight sync does not."""

    @property
    def lora_path(self) -> str:
        return f"{ADAPTER_PATH_SCHEME}{self.name}/{self.installs}"


class AdapterTable:
    """The adapters a backend serves, by name; bookkeeping only (no engine call, no I/O).

    Thread-safe: requests read it from any thread, syncs write it.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._adapters: dict[str, ServedAdapter] = {}
        self._next_id = 1

    def __repr__(self) -> str:
        with self._lock:
            names = {n: a.version for n, a in self._adapters.items()}
        return f"<AdapterTable {len(names)}/{self.capacity}: {names}>"

    def __iter__(self) -> Iterator[ServedAdapter]:
        with self._lock:
            return iter(list(self._adapters.values()))

    def __len__(self) -> int:
        return len(self._adapters)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def get(self, name: str) -> ServedAdapter:
        """The adapter ``name``. Raises KeyError naming the adapters served."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise KeyError(
                    f"no adapter {name!r} is served (serving {sorted(self._adapters)}); add it "
                    "first: add_adapter(name, config)"
                )
            return adapter

    def add(
        self, name: str, config: LoRAConfig, shapes: Mapping[str, tuple[int, int]]
    ) -> ServedAdapter:
        """Record ``name`` with an all-zero set (it changes nothing until a version lands).

        Raises:
            ValueError: the name is not a non-empty string or is served already, no place is
                free, or a target module is not one of ``shapes``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter's name must be a non-empty string, got {name!r}")
        if not isinstance(config, LoRAConfig):
            raise ValueError(f"add_adapter takes a rollout_sync.lora.LoRAConfig, got {config!r}")
        specs = adapter_specs(config, shapes)
        with self._lock:
            if name in self._adapters:
                raise ValueError(f"adapter {name!r} is served already")
            if len(self._adapters) >= self.capacity:
                raise ValueError(
                    f"no place for adapter {name!r}: {len(self._adapters)} of "
                    f"VLLMLoRASettings.max_adapters={self.capacity} are served "
                    f"({sorted(self._adapters)}); raise max_adapters"
                )
            tensors = {
                n: (
                    torch.tensor(float(config.alpha), dtype=torch.float32)
                    if n == ALPHA_KEY
                    else torch.zeros(s.shape, dtype=s.dtype)
                )
                for n, s in specs.items()
            }
            adapter = ServedAdapter(name, self._next_id, config, tensors)
            self._next_id += 1
            self._adapters[name] = adapter
            return adapter

    def remove(self, name: str) -> None:
        with self._lock:
            self._adapters.pop(name, None)


# -- the engine side ---------------------------------------------------------------------------


def _payload(tensors: Mapping[str, torch.Tensor]) -> bytes:
    import safetensors.torch

    return safetensors.torch.save(
        {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    )


def encode_adapter(config: LoRAConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """An adapter set as plain data for ``collective_rpc`` (tensors do not cross a process
    boundary as tensors): the safetensors bytes of its A and B, its rank, alpha, modules."""
    return {
        "rank": config.rank,
        "alpha": float(tensors[ALPHA_KEY]),
        "modules": list(config.target_modules),
        "payload": _payload({n: t for n, t in tensors.items() if n != ALPHA_KEY}),
    }


@dataclass
class WorkerAdapter:
    """An adapter as the engine side keeps it, to install again after vLLM dropped it."""

    lora_id: int
    name: str
    rank: int
    alpha: float
    modules: tuple[str, ...]
    tensors: dict[str, torch.Tensor]
    """Names as :func:`~rollout_sync.lora.adapter_specs` gives them, without ``lora_alpha``;
    never handed to vLLM (which scales ``B`` in place): copies are."""


@dataclass
class WorkerLoRAState:
    """The engine side's adapters (by vLLM id) and what went wrong re-installing them."""

    adapters: dict[int, WorkerAdapter] = field(default_factory=dict)
    lost: dict[str, str] = field(default_factory=dict)
    """Adapters that could not be installed again after a base weight write, and why."""
    hooked: bool = False


def _lora_manager(worker: Any) -> Any:
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError(
            "the engine runs without LoRA: start it with VLLMEngineConfig(lora="
            "VLLMLoRASettings(...)) to serve adapters"
        )
    return manager


def slot_layout(worker: Any) -> list[tuple[str, Any, list[str]]]:
    """``(vLLM module, LoRA layer, the module path of each slice)`` for every linear layer
    vLLM wrapped for LoRA: ``qkv_proj`` has three slices (``q_proj``, ``k_proj``,
    ``v_proj``), ``o_proj`` one."""
    mm = _lora_manager(worker)._adapter_manager
    layout: list[tuple[str, Any, list[str]]] = []
    for name, module in mm.modules.items():
        stacked = getattr(module, "lora_a_stacked", None)
        if not isinstance(stacked, tuple) or not stacked or stacked[0].dim() != 4:
            continue
        parts = list(mm.packed_modules.get(name, [name]))
        if len(parts) != len(stacked):
            continue
        layout.append((name, module, parts))
    return layout


def lora_shapes_served(worker: Any) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of every slice vLLM adapts, by checkpoint module path. A slice whose path
    the model renames when loading an adapter (its ``hf_to_vllm_mapper``; vLLM's Llama renames
    none of these) is left out: an adapter naming it could not be placed by name."""
    mm = _lora_manager(worker)._adapter_manager
    mapper = getattr(mm.model, "hf_to_vllm_mapper", None)
    rename = None if mapper is None else mapper.get_rename_mapper()
    shapes: dict[str, tuple[int, int]] = {}
    for _name, module, parts in slot_layout(worker):
        for s, part in enumerate(parts):
            if rename is not None and rename._map_name(part) != part:
                continue
            shapes[part] = (
                int(module.lora_a_stacked[s].shape[3]),
                int(module.lora_b_stacked[s].shape[2]),
            )
    return shapes


def describe_lora(worker: Any, state: WorkerLoRAState) -> dict[str, Any]:
    """What the engine can serve: the LoRA settings, the lora dtype and every adaptable
    module's ``(in, out)`` by Hugging Face path. Hooks the re-install after base writes."""
    manager = _lora_manager(worker)
    mm = manager._adapter_manager
    shapes = {m: [i, o] for m, (i, o) in lora_shapes_served(worker).items()}
    keep_adapters_across_weight_writes(worker, state)
    config = manager.lora_config
    return {
        "max_loras": int(config.max_loras),
        "max_adapters": int(mm.capacity),
        "max_lora_rank": int(config.max_lora_rank),
        "lora_dtype": str(config.lora_dtype).removeprefix("torch."),
        "shapes": shapes,
    }


def keep_adapters_across_weight_writes(worker: Any, state: WorkerLoRAState) -> None:
    """Make the model runner install every adapter of ``state`` again right after vLLM drops
    them all (``reset_lora_state``, which vLLM calls after every base weight write: its
    in-place reload and the end of a native update). Once per worker."""
    if state.hooked:
        return
    runner = worker.model_runner
    drop_all = runner.reset_lora_state

    def reset_lora_state() -> None:
        drop_all()
        for adapter in list(state.adapters.values()):
            try:
                problems = install_adapter(worker, adapter, verify=True)
            except Exception as exc:  # recorded: the backend asks after each base write
                problems = [f"{type(exc).__name__}: {exc}"]
            if problems:
                state.lost[adapter.name] = "; ".join(problems[:3])
            else:
                state.lost.pop(adapter.name, None)

    runner.reset_lora_state = reset_lora_state
    state.hooked = True


def decode_adapter(lora_id: int, name: str, data: Mapping[str, Any]) -> WorkerAdapter:
    import safetensors.torch

    return WorkerAdapter(
        lora_id=int(lora_id),
        name=name,
        rank=int(data["rank"]),
        alpha=float(data["alpha"]),
        modules=tuple(data["modules"]),
        tensors=dict(safetensors.torch.load(data["payload"])),
    )


def refusals(worker: Any, adapter: WorkerAdapter) -> list[str]:
    """Every reason the engine cannot take ``adapter`` (empty: it can); checked before the
    engine is touched."""
    manager = _lora_manager(worker)
    config = manager.lora_config
    shapes = lora_shapes_served(worker)
    problems: list[str] = []
    if adapter.rank > int(config.max_lora_rank):
        problems.append(
            f"rank {adapter.rank} exceeds the engine's max_lora_rank {config.max_lora_rank}"
        )
    if not math.isfinite(adapter.alpha):
        problems.append(f"lora_alpha {adapter.alpha} is not finite")
    dtype = config.lora_dtype
    for module in adapter.modules:
        if module not in shapes:
            problems.append(f"{module}: not a LoRA layer of the served model")
            continue
        fan_in, fan_out = shapes[module]
        for key, shape in (
            (".lora_A", (adapter.rank, fan_in)),
            (".lora_B", (fan_out, adapter.rank)),
        ):
            tensor = adapter.tensors.get(module + key)
            if tensor is None:
                problems.append(f"{module}{key}: missing")
            elif tuple(tensor.shape) != shape or tensor.dtype != dtype:
                problems.append(
                    f"{module}{key}: {tuple(tensor.shape)} {tensor.dtype}, the engine serves "
                    f"{shape} {dtype}"
                )
    extra = set(adapter.tensors) - {m + k for m in adapter.modules for k in (".lora_A", ".lora_B")}
    problems.extend(f"{n}: not a tensor of the adapter's modules" for n in sorted(extra))
    return problems


def build_lora_model(worker: Any, adapter: WorkerAdapter) -> tuple[Any, float]:
    """vLLM's ``LoRAModel`` of ``adapter`` (from copies of its tensors: vLLM scales ``B`` in
    place), checked as vLLM checks an adapter read from disk, and its ``alpha / rank``. Touches
    nothing in the engine (the module docstring's step 1)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = _lora_manager(worker)
    leaves = sorted({m.rpartition(".")[2] for m in adapter.modules})
    helper = PEFTHelper.from_dict(
        {
            "r": adapter.rank,
            "lora_alpha": adapter.alpha,
            "target_modules": leaves,
            "bias": "none",
            "vllm_max_position_embeddings": manager.max_position_embeddings,
        }
    )
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    peft: dict[str, torch.Tensor] = {}
    for module in adapter.modules:
        for which in ("lora_A", "lora_B"):
            peft[f"base_model.model.{module}.{which}.weight"] = adapter.tensors[
                f"{module}.{which}"
            ].clone()
    lora = LoRAModel.from_lora_tensors(
        adapter.lora_id,
        peft,
        helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    return lora, float(helper.vllm_lora_scaling_factor)


def put_in_slot(worker: Any, lora_id: int, lora: Any) -> None:
    """Replace the adapter ``lora_id`` with ``lora`` and put it in a slot, as vLLM's in-place
    reload does (step 2): remove, evict the oldest unpinned if the cache is full, add (packs
    and scales), activate, pin in the host cache, re-pin a slot that was pinned."""
    mm = _lora_manager(worker)._adapter_manager
    slot_pinned = lora_id in mm._active_adapters.pinned_items
    mm.remove_adapter(lora_id)
    if len(mm) + 1 > mm.capacity:
        mm.remove_oldest_adapter()
    mm.add_adapter(lora)
    mm.activate_adapter(lora_id)
    mm._registered_adapters.pin(lora_id)
    if slot_pinned:
        mm.pin_adapter(lora_id)


def install_adapter(worker: Any, adapter: WorkerAdapter, *, verify: bool) -> list[str]:
    """Steps 1-2 for ``adapter``, and with ``verify`` step 3; returns the read-back's problems
    (empty: landed). Raises whatever vLLM raises."""
    lora, scaling = build_lora_model(worker, adapter)
    put_in_slot(worker, adapter.lora_id, lora)
    return verify_slot(worker, adapter, scaling) if verify else []


def read_slot(worker: Any, lora_id: int) -> dict[str, torch.Tensor]:
    """The slot of adapter ``lora_id`` as the forward reads it, per adapted slice: ``<module>
    .lora_A`` ``[max_rank, in]`` and ``<module>.lora_B`` ``[out, max_rank]`` (``B`` scaled),
    copies. Raises ValueError when the adapter holds no slot."""
    mm = _lora_manager(worker)._adapter_manager
    if lora_id not in mm.lora_index_to_id:
        mm.activate_adapter(lora_id)  # the cached copy into a slot, as a request would
    slot = mm.lora_index_to_id.index(lora_id)
    out: dict[str, torch.Tensor] = {}
    for _name, module, parts in slot_layout(worker):
        for s, part in enumerate(parts):
            out[f"{part}.lora_A"] = module.lora_a_stacked[s][slot, 0].detach().clone().cpu()
            out[f"{part}.lora_B"] = module.lora_b_stacked[s][slot, 0].detach().clone().cpu()
    return out


def verify_slot(worker: Any, adapter: WorkerAdapter, scaling: float) -> list[str]:
    """Every way the slot of ``adapter`` differs from ``A`` and ``B * scaling`` (zeros outside
    the adapter's rank and modules); empty when it landed bit for bit."""
    mm = _lora_manager(worker)._adapter_manager
    if adapter.lora_id not in mm.lora_index_to_id:
        return [f"adapter {adapter.name!r} holds no slot after the install"]
    slot = mm.lora_index_to_id.index(adapter.lora_id)
    r = adapter.rank
    problems: list[str] = []
    for _name, module, parts in slot_layout(worker):
        for s, part in enumerate(parts):
            got_a = module.lora_a_stacked[s][slot, 0]
            got_b = module.lora_b_stacked[s][slot, 0]
            want_a = torch.zeros_like(got_a)
            want_b = torch.zeros_like(got_b)
            a = adapter.tensors.get(part + ".lora_A")
            b = adapter.tensors.get(part + ".lora_B")
            if a is not None and b is not None:
                want_a[:r, : a.shape[1]] = a
                scaled = b.clone()
                if scaling != 1:
                    scaled *= scaling
                want_b[: b.shape[0], :r] = scaled
            for which, got, want in (("lora_A", got_a, want_a), ("lora_B", got_b, want_b)):
                if not torch.equal(got, want.to(got.device)):
                    diff = (got.float() - want.to(got.device).float()).abs().max().item()
                    problems.append(
                        f"{part}.{which}: the slot holds other values (max |diff| {diff:.3g})"
                    )
    return problems


def timed_install(worker: Any, state: WorkerLoRAState, adapter: WorkerAdapter) -> dict[str, Any]:
    """Check, install and read back ``adapter``; the report as plain data, never raised (see
    the worker extension's ``rollout_sync_write``): ``refused`` (nothing changed), ``error``
    (vLLM raised part-way: the adapter is no longer served right), ``problems`` (the slot
    differs from the set), ``install_ms``, ``verify_ms``."""
    try:
        refused = refusals(worker, adapter)
        if refused:
            return {"installed": False, "refused": refused, "problems": []}
        lora, scaling = build_lora_model(worker, adapter)
    except Exception as exc:
        return {"installed": False, "refused": [f"{type(exc).__name__}: {exc}"], "problems": []}
    start = time.monotonic_ns()
    try:
        put_in_slot(worker, adapter.lora_id, lora)
    except Exception as exc:
        state.adapters.pop(adapter.lora_id, None)
        return {
            "installed": True,
            "refused": [],
            "problems": [],
            "error": f"vLLM raised {type(exc).__name__} installing the adapter: {exc}",
        }
    installed = time.monotonic_ns()
    problems = verify_slot(worker, adapter, scaling)
    if problems:
        state.adapters.pop(adapter.lora_id, None)
    else:
        state.adapters[adapter.lora_id] = adapter
        state.lost.pop(adapter.name, None)
    return {
        "installed": True,
        "refused": [],
        "problems": problems,
        "install_ms": (installed - start) / 1e6,
        "verify_ms": (time.monotonic_ns() - installed) / 1e6,
    }


def merged_reports(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report for every worker's (a single worker at ``tensor_parallel_size=1``)."""
    if len(reports) == 1:
        return dict(reports[0])
    return {
        "installed": any(r.get("installed") for r in reports),
        "refused": [f"worker {i}: {x}" for i, r in enumerate(reports) for x in r["refused"]],
        "problems": [f"worker {i}: {x}" for i, r in enumerate(reports) for x in r["problems"]],
        "error": "; ".join(str(r["error"]) for r in reports if r.get("error")) or None,
        "install_ms": max(float(r.get("install_ms", math.nan)) for r in reports),
        "verify_ms": max(float(r.get("verify_ms", math.nan)) for r in reports),
    }
