"""A tiny random Llama, built locally with transformers: the model vLLM tests and demos serve.

No hub access: the checkpoint is written from a config. Weights are drawn with std 0.5 rather
than transformers' 0.02 by default, so greedy decoding has clear winners (near-flat logits make
argmax comparisons fragile); a policy that must learn starts from ``std=0.02`` (near-uniform
sampling, as transformers' own init), since from 0.5 every prompt has a few tokens it almost
always emits. float32 throughout, so vLLM's output equals a transformers forward exactly.
``transformers`` is imported lazily (it comes with vLLM).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TINY_LLAMA",
    "build_tiny_llama",
    "find_sync_split",
    "greedy_reference",
    "random_llama_weights",
    "tiny_llama",
]

TINY_LLAMA: Mapping[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,  # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ...
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def random_llama_weights(
    names_and_shapes: Mapping[str, Sequence[int]],
    seed: int,
    dtype: torch.dtype = torch.float32,
    *,
    std: float = 0.5,
) -> dict[str, torch.Tensor]:
    """A full set of random weights for the given names and shapes (a new policy version).

    Norm weights are drawn around 1 (std 0.1), everything else with ``std``; deterministic in
    ``seed``.
    """
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in names_and_shapes.items():
        noise = torch.randn(tuple(shape), generator=generator, dtype=torch.float32)
        weights[name] = (1.0 + 0.1 * noise if "norm" in name else std * noise).to(dtype)
    return weights


def tiny_llama(*, seed: int = 0, std: float = 0.5, **overrides: Any) -> Any:
    """The tiny Llama in memory: a float32 ``transformers.LlamaForCausalLM`` of
    :data:`TINY_LLAMA` (``overrides`` change entries) holding :func:`random_llama_weights` of
    ``seed`` and ``std``; what :func:`build_tiny_llama` writes (its parameters are named like
    the checkpoint's tensors)."""
    import transformers

    config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    config.torch_dtype = torch.float32  # type: ignore[misc]  # a property in typing only
    model = transformers.LlamaForCausalLM(config)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    model.load_state_dict(random_llama_weights(shapes, seed, std=std))
    return model


def build_tiny_llama(
    directory: str | os.PathLike[str], *, seed: int = 0, std: float = 0.5, **overrides: Any
) -> dict[str, torch.Tensor]:
    """Write a tiny random Llama checkpoint (config + safetensors) into ``directory``: the
    weights of :func:`tiny_llama` (``seed``, ``std``, ``overrides``).

    Returns its weights (checkpoint names).
    """
    import safetensors.torch

    model = tiny_llama(seed=seed, std=std, **overrides)
    config = model.config
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    Path(directory).mkdir(parents=True, exist_ok=True)
    # Written by hand, not with save_pretrained: inside a torch.distributed job that one
    # writes on rank 0 only, and every rank here builds its own copy.
    config.save_pretrained(directory)
    safetensors.torch.save_file(
        {name: tensor.contiguous() for name, tensor in weights.items()},
        str(Path(directory) / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return weights


class greedy_reference:
    """Greedy continuations by a plain transformers forward: what the engine must reproduce.

    ``greedy_reference(model_dir)(weights, prompt, n)`` loads ``weights`` and returns the ``n``
    tokens greedy decoding appends to ``prompt`` (full forward per token, no cache: the plain
    reference).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        import transformers

        self._model = transformers.LlamaForCausalLM.from_pretrained(
            directory, torch_dtype=torch.float32
        )
        self._model.eval()

    @torch.no_grad()
    def __call__(
        self, weights: Mapping[str, torch.Tensor], prompt: Sequence[int], n: int
    ) -> list[int]:
        self._model.load_state_dict(dict(weights))
        ids = torch.tensor([list(prompt)], dtype=torch.long)
        out: list[int] = []
        for _ in range(n):
            logits = self._model(ids).logits[0, -1]
            token = int(torch.argmax(logits))
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        return out


def find_sync_split(
    tokens: Sequence[int],
    old: Sequence[int],
    new_from: Callable[[int], Sequence[int]],
    *,
    at_least: int = 0,
) -> int | None:
    """Where a sync split a greedy generation, if the tokens are "old weights, then new ones".

    ``old`` is the old weights' greedy continuation of the prompt; ``new_from(k)`` the new
    weights' continuation of the prompt plus ``tokens[:k]``, ``len(tokens) - k`` tokens long.
    Returns the largest ``k >= at_least`` with ``tokens[:k] == old[:k]`` and
    ``tokens[k:] == new_from(k)``, or ``None`` when no split explains the tokens (a mix).
    """
    agree = 0
    while agree < min(len(tokens), len(old)) and tokens[agree] == old[agree]:
        agree += 1
    for k in range(agree, at_least - 1, -1):
        if list(tokens[k:]) == list(new_from(k)):
            return k
    return None
