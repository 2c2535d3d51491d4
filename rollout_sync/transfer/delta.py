"""Deltas: one version of a tensor as the elements that changed since a base version.

A training step changes a few percent of a model's served elements (docs/learning.md measures
63 % at the toy task's learning rate, the delta-sync issue 1-4 % for an LLM at 1e-6). A
:class:`TensorDelta` names them and their new values, block by block: each block of
:data:`BLOCK_ELEMENTS` elements of the flat tensor, in its served dtype, is encoded whichever
way is smallest (:class:`BlockKind`):

* ``POSITIONS``: the changed elements' 16-bit offsets within the block, then their values:
  ``(2 + e) c`` bytes for ``c`` changed elements of ``e`` bytes (about ``2 f`` of the dense
  bytes at a changed fraction ``f`` for bf16);
* ``BITMASK``: one bit per element of the block, then the changed values: ``n / 8 + e c``;
* ``DENSE``: the whole block: ``e n``;
* an unchanged block is not sent at all.

"Changed" is bit for bit in the served dtype (``-0.0`` differs from ``0.0``; a NaN equals
itself when its bits do), so applying a delta to its base gives the new version's bytes
exactly.

A receiver checks a whole delta before it writes anything (:func:`check_delta`: the tensor's
size and dtype, every block's index, kind and byte count, positions in range and strictly
increasing, so none repeats), then applies it (:func:`apply_delta`), keeping the values it
overwrote so that :meth:`Overwritten.restore` puts them back. :func:`linear_digest` is a
digest of a tensor's bits that :func:`updated_digest` moves from the changed elements alone
(old and new values), so a receiver proves its result equals the sender's new version without
reading the whole tensor: the same family as the bucket checksums (sums of the words, plain
and weighted by position, modulo a prime).

On the wire a delta is one ``uint8`` tensor (:func:`pack_delta`, :func:`unpack_delta`): a
table of ``int64`` words (a magic word, the block count, then each block's index, kind and
count) followed by the blocks' payloads, so a transfer carries it as it carries any tensor.

This module is the encoding and its checks; what a sync sends, and the fallbacks to a whole
version, are :mod:`rollout_sync.transfer.delta_sync`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..errors import DeltaError

__all__ = [
    "BLOCK_ELEMENTS",
    "BlockKind",
    "DeltaBlock",
    "Overwritten",
    "TensorDelta",
    "apply_changes",
    "apply_delta",
    "bits_of",
    "changed_positions",
    "check_delta",
    "delta_changes",
    "delta_of_changes",
    "encode_delta",
    "encoded_bytes",
    "linear_digest",
    "moved_digest",
    "pack_delta",
    "unpack_delta",
    "updated_digest",
]

BLOCK_ELEMENTS = 1 << 16
"""Elements per block: a position within a block fits 16 bits."""

_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGEST_PRIME = (1 << 31) - 1
"""Digest terms are reduced modulo this prime: a product of two reduced terms fits an int64,
and so does a sum of 2**32 of them."""


class BlockKind(enum.IntEnum):
    """How one block of a delta is encoded."""

    POSITIONS = 1
    BITMASK = 2
    DENSE = 3


@dataclass(frozen=True)
class DeltaBlock:
    """One changed block: which, how, how many elements changed, and its bytes."""

    index: int
    kind: BlockKind
    count: int
    """Changed elements (for ``DENSE``, the block's size)."""
    payload: torch.Tensor
    """``uint8``: positions or bitmask (if any), then the values, in the tensor's dtype."""


@dataclass(frozen=True)
class TensorDelta:
    """A tensor's new version as its changes against a base version of the same shape."""

    numel: int
    dtype: torch.dtype
    blocks: tuple[DeltaBlock, ...]

    @property
    def nbytes(self) -> int:
        """The bytes of every block's payload: what the delta costs on the wire."""
        return sum(b.payload.numel() for b in self.blocks)

    @property
    def changed(self) -> int:
        """Elements this delta writes (a dense block writes all of its elements)."""
        return sum(b.count for b in self.blocks)


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    """The flat tensor's bits as integers of its element size (a view: writing it writes the
    tensor)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(_INTEGER_OF_SIZE[flat.element_size()])


def _block_size(numel: int, index: int) -> int:
    return min(BLOCK_ELEMENTS, numel - index * BLOCK_ELEMENTS)


def encoded_bytes(kind: BlockKind, n: int, count: int, element_size: int) -> int:
    """The payload bytes of a block of ``n`` elements, ``count`` changed, encoded as ``kind``."""
    if kind is BlockKind.POSITIONS:
        return (2 + element_size) * count
    if kind is BlockKind.BITMASK:
        return -(-n // 8) + element_size * count
    return element_size * n


def changed_positions(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """The flat positions (``int64``, increasing) where ``new``'s bits differ from ``base``'s
    (same shape and dtype).

    Raises:
        ValueError: ``base`` and ``new`` differ in shape or dtype.
    """
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(
            f"a delta needs a base of the same shape and dtype: {list(base.shape)} "
            f"{base.dtype} against {list(new.shape)} {new.dtype}"
        )
    return (bits_of(base) != bits_of(new)).nonzero().reshape(-1)


def encode_delta(
    base: torch.Tensor, new: torch.Tensor, *, changed: torch.Tensor | None = None
) -> TensorDelta:
    """``new`` as its changes against ``base`` (same shape and dtype), each changed block in
    its smallest encoding. ``changed``: :func:`changed_positions` of the two, if the caller
    has them already.

    Raises:
        ValueError: ``base`` and ``new`` differ in shape or dtype.
    """
    if changed is None:
        changed = changed_positions(base, new)
    values = new.detach().reshape(-1)
    size = new.element_size()
    numel = values.numel()
    blocks: list[DeltaBlock] = []
    for index, n, offsets in _changed_blocks(changed, numel):
        start = index * BLOCK_ELEMENTS
        count = offsets.numel()
        kind = min(BlockKind, key=lambda k: (encoded_bytes(k, n, count, size), k))
        blocks.append(_encode_block(index, kind, offsets, values[start : start + n]))
    return TensorDelta(numel, new.dtype, tuple(blocks))


def _changed_blocks(positions: torch.Tensor, numel: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Per block with changes at the flat ``positions`` (increasing) of a tensor of ``numel``
    elements: its index, its size and the changed offsets in it."""
    if not positions.numel():
        return
    which = torch.div(positions, BLOCK_ELEMENTS, rounding_mode="floor")
    indices, counts = torch.unique_consecutive(which, return_counts=True)
    at = 0
    for index, count in zip(indices.tolist(), counts.tolist(), strict=True):
        yield index, _block_size(numel, index), positions[at : at + count] - index * BLOCK_ELEMENTS
        at += count


def _encode_block(
    index: int, kind: BlockKind, offsets: torch.Tensor, block: torch.Tensor
) -> DeltaBlock:
    if kind is BlockKind.DENSE:
        return DeltaBlock(index, kind, block.numel(), block.contiguous().view(torch.uint8))
    changed_values = block[offsets].contiguous().view(torch.uint8)
    if kind is BlockKind.POSITIONS:
        # Offsets below 2**16 as 16-bit words (their bits, whatever the sign bit reads as).
        head = offsets.to(torch.int32).to(torch.int16).view(torch.uint8)
    else:
        mask = torch.zeros(-(-block.numel() // 8) * 8, dtype=torch.bool)
        mask[offsets] = True
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
        head = (mask.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)
    payload = torch.cat([head.reshape(-1), changed_values.reshape(-1)])
    return DeltaBlock(index, kind, offsets.numel(), payload)


def _offsets(block: DeltaBlock, n: int) -> torch.Tensor:
    """The changed offsets a checked block names (``int64``)."""
    if block.kind is BlockKind.DENSE:
        return torch.arange(n)
    if block.kind is BlockKind.POSITIONS:
        raw = block.payload[: 2 * block.count].view(torch.int16).to(torch.int64)
        return raw & 0xFFFF
    mask_bytes = -(-n // 8)
    bits = (
        block.payload[:mask_bytes]
        .unsqueeze(1)
        .bitwise_and(torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8))
    )
    return (bits.reshape(-1)[:n] != 0).nonzero().reshape(-1)


def _values(block: DeltaBlock, n: int, dtype: torch.dtype) -> torch.Tensor:
    head = {BlockKind.DENSE: 0, BlockKind.POSITIONS: 2 * block.count}.get(block.kind, -(-n // 8))
    # A fresh buffer: the values after a head need not be aligned for their dtype.
    return block.payload[head:].clone().view(dtype)


def check_delta(delta: TensorDelta, target: torch.Tensor, *, name: str = "tensor") -> None:
    """Refuse, before anything is written, a delta that cannot apply to ``target``.

    Raises:
        DeltaError: the size or dtype differs, a block's index is out of range or repeats (or
            the blocks are out of order), its kind is unknown, its byte count does not match
            its kind and count, or its positions are out of range, not increasing, or
            repeated; or a bitmask's count of set bits is not its count. The message names
            ``name`` and the block.
    """
    problems: list[str] = []
    if target.numel() != delta.numel or target.dtype != delta.dtype:
        raise DeltaError(
            f"{name}: a delta of {delta.numel} {delta.dtype} elements for a tensor of "
            f"{target.numel()} {target.dtype}"
        )
    size = target.element_size()
    blocks = -(-delta.numel // BLOCK_ELEMENTS)
    previous = -1
    for block in delta.blocks:
        where = f"{name} block {block.index}"
        if not previous < block.index < blocks:
            problems.append(f"{where}: index out of range or out of order (after {previous})")
            break
        previous = block.index
        n = _block_size(delta.numel, block.index)
        if block.kind not in tuple(BlockKind) or not 0 < block.count <= n:
            problems.append(f"{where}: kind {block.kind!r} with {block.count} elements of {n}")
            break
        if block.kind is BlockKind.DENSE and block.count != n:
            problems.append(f"{where}: a dense block of {block.count} elements, not {n}")
            break
        expected = encoded_bytes(BlockKind(block.kind), n, block.count, size)
        if block.payload.dtype != torch.uint8 or block.payload.numel() != expected:
            problems.append(
                f"{where}: {block.payload.numel()} bytes where its kind and count make "
                f"{expected} (truncated?)"
            )
            break
        offsets = _offsets(block, n)
        if offsets.numel() != block.count:
            problems.append(f"{where}: its mask sets {offsets.numel()} elements, not {block.count}")
            break
        if offsets.numel() and (int(offsets[-1]) >= n or int(offsets[0]) < 0):
            problems.append(f"{where}: a position out of range (the block has {n} elements)")
            break
        if offsets.numel() > 1 and not bool((offsets[1:] > offsets[:-1]).all()):
            problems.append(f"{where}: positions not strictly increasing (unsorted or repeated)")
            break
    if problems:
        raise DeltaError("; ".join(problems))


@dataclass
class Overwritten:
    """What :func:`apply_delta` overwrote: each block's flat positions and old bits."""

    target: torch.Tensor
    positions: list[torch.Tensor]
    old_bits: list[torch.Tensor]

    def restore(self) -> None:
        """Put every overwritten element back (bit for bit), in reverse order."""
        bits = bits_of(self.target)
        for positions, old in zip(reversed(self.positions), reversed(self.old_bits), strict=True):
            bits[positions] = old

    def digest_update(self, digest: tuple[int, int]) -> tuple[int, int]:
        """``digest`` of the target before the apply, moved to its state after it."""
        bits = bits_of(self.target)
        out = digest
        for positions, old in zip(self.positions, self.old_bits, strict=True):
            out = updated_digest(out, positions, old, bits[positions])
        return out


def apply_delta(target: torch.Tensor, delta: TensorDelta, *, name: str = "tensor") -> Overwritten:
    """Check ``delta`` against ``target`` (:func:`check_delta`), then write its new values in
    place; returns what it overwrote.

    Raises:
        DeltaError: as :func:`check_delta`; nothing was written.
    """
    check_delta(delta, target, name=name)
    positions, new_bits = delta_changes(delta)
    return apply_changes(target, positions, new_bits)


def apply_changes(
    target: torch.Tensor,
    positions: torch.Tensor,
    new_bits: torch.Tensor,
    *,
    undo: list[Overwritten] | None = None,
) -> Overwritten:
    """Write ``new_bits`` (integers of the element size) at the flat ``positions`` of
    ``target`` (checked already: :func:`delta_changes` of a checked delta); returns what it
    overwrote. ``undo``: a list that what it overwrites joins before the write, so that a
    write failing part-way is put back too."""
    bits = bits_of(target)
    overwritten = Overwritten(target, [positions], [bits[positions]])  # a gather: a copy
    if undo is not None:
        undo.append(overwritten)
    bits[positions] = new_bits
    return overwritten


def moved_digest(
    digest: tuple[int, int], base: torch.Tensor, delta: TensorDelta, *, name: str = "tensor"
) -> tuple[int, int]:
    """``digest`` (of ``base``) moved to what ``base`` would be with ``delta`` applied, from
    the changed elements alone; nothing is written.

    Raises:
        DeltaError: as :func:`check_delta`.
    """
    check_delta(delta, base, name=name)
    positions, new_bits = delta_changes(delta)
    return updated_digest(digest, positions, bits_of(base)[positions], new_bits)


def linear_digest(tensor: torch.Tensor) -> tuple[int, int]:
    """``(sum x_i, sum (i + 1) x_i)`` modulo a prime over the tensor's elements read as
    integers of their size (its bits): equal for equal bytes, moved by
    :func:`updated_digest` from the changed elements alone."""
    return _digest_terms(torch.arange(tensor.numel()), bits_of(tensor))


def updated_digest(
    digest: tuple[int, int],
    positions: torch.Tensor,
    old_bits: torch.Tensor,
    new_bits: torch.Tensor,
) -> tuple[int, int]:
    """``digest`` after the elements at flat ``positions`` changed from ``old_bits`` to
    ``new_bits`` (their bits as integers, as :func:`linear_digest` reads them)."""
    old = _digest_terms(positions, old_bits)
    new = _digest_terms(positions, new_bits)
    p = _DIGEST_PRIME
    return ((digest[0] - old[0] + new[0]) % p, (digest[1] - old[1] + new[1]) % p)


def _digest_terms(positions: torch.Tensor, bits: torch.Tensor) -> tuple[int, int]:
    """The digest's two sums over elements at flat ``positions`` with these ``bits``: each
    element read as unsigned words of at most 32 bits (an 8-byte element as two), every term
    reduced modulo a 31-bit prime, so no product or sum overflows int64. Elements of at most
    16 bits skip the reductions they do not need (a word is below the prime; a product below
    2**47, so sums of 2**15 of them fit), which makes a whole tensor's digest a few passes."""
    p = _DIGEST_PRIME
    if bits.element_size() == 8:
        words = bits.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        where = torch.stack([2 * positions, 2 * positions + 1], dim=1).reshape(-1)
    else:
        words = bits.to(torch.int64) & ((1 << (8 * bits.element_size())) - 1)
        where = positions
    if not words.numel():
        return 0, 0
    narrow = bits.element_size() <= 2
    values = words if narrow else words.remainder(p)  # below the prime either way
    weights = where.to(torch.int64) + 1
    if int(weights.max()) >= p:
        weights = weights.remainder(p)
    plain = int(values.sum()) % p  # fewer than 2**32 terms below 2**31
    products = values.mul_(weights) if narrow else (values * weights).remainder_(p)
    return plain, _sum_mod(products, p, 1 << 15)


def _sum_mod(terms: torch.Tensor, p: int, chunk: int) -> int:
    """``sum(terms) % p`` for terms below 2**47, summed ``chunk`` at a time (no overflow)."""
    whole = terms.numel() - terms.numel() % chunk
    total = int(terms[whole:].sum()) % p
    if whole:
        total += int(terms[:whole].view(-1, chunk).sum(1).remainder_(p).sum())
    return total % p


_PACK_MAGIC = 0x5244454C54410001
"""The first word of a packed delta ("RDELTA", format 1)."""


def pack_delta(delta: TensorDelta) -> torch.Tensor:
    """``delta`` as one ``uint8`` tensor: its block table (``int64`` words: the magic word,
    the block count, then index, kind and count of each block), then every block's payload."""
    table = [_PACK_MAGIC, len(delta.blocks)]
    for block in delta.blocks:
        table += [block.index, int(block.kind), block.count]
    head = torch.tensor(table, dtype=torch.int64).view(torch.uint8)
    return torch.cat([head, *(b.payload.reshape(-1) for b in delta.blocks)])


def unpack_delta(
    packed: torch.Tensor, *, numel: int, dtype: torch.dtype, name: str = "tensor"
) -> TensorDelta:
    """The :class:`TensorDelta` that :func:`pack_delta` packed, for a tensor of ``numel``
    elements of ``dtype``; the payloads are views of ``packed``. Its blocks are not checked
    here beyond their sizes: :func:`check_delta` does that before any write.

    Raises:
        DeltaError: ``packed`` is not a packed delta (no magic word), or its table and bytes
            disagree (a truncated or padded delta); the message names ``name``.
    """
    data = packed.detach().reshape(-1)
    if data.dtype != torch.uint8:
        raise DeltaError(f"{name}: a packed delta is uint8 bytes, got {data.dtype}")
    words = data.numel() // 8
    if words < 2:
        raise DeltaError(f"{name}: {data.numel()} bytes are too few for a delta (truncated?)")
    head = data[:16].clone().view(torch.int64).tolist()
    if head[0] != _PACK_MAGIC or not 0 <= head[1] <= -(-numel // BLOCK_ELEMENTS):
        raise DeltaError(f"{name}: not a packed delta (magic word or block count wrong)")
    count = head[1]
    table_bytes = 8 * (2 + 3 * count)
    if data.numel() < table_bytes:
        raise DeltaError(f"{name}: {data.numel()} bytes end inside the block table (truncated?)")
    table = data[16:table_bytes].clone().view(torch.int64).view(-1, 3).tolist()
    size = torch.empty((), dtype=dtype).element_size()
    blocks: list[DeltaBlock] = []
    at = table_bytes
    for index, kind, changed in table:
        if kind not in tuple(int(k) for k in BlockKind) or not 0 <= index * BLOCK_ELEMENTS < numel:
            raise DeltaError(f"{name}: block {index} of kind {kind}: not a block of this tensor")
        n = _block_size(numel, index)
        if not 0 < changed <= n:
            raise DeltaError(f"{name} block {index}: {changed} changed elements of {n}")
        nbytes = encoded_bytes(BlockKind(kind), n, changed, size)
        blocks.append(DeltaBlock(index, BlockKind(kind), changed, data[at : at + nbytes]))
        at += nbytes
    if at != data.numel():
        raise DeltaError(
            f"{name}: the block table makes {at} bytes, the packed delta has {data.numel()} "
            "(truncated or padded)"
        )
    return TensorDelta(numel, dtype, tuple(blocks))


def delta_changes(delta: TensorDelta) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat positions a checked delta writes (``int64``, strictly increasing) and the
    bits of their new values (integers of the element size): what a receiver that writes
    elements by its own index (a region of a larger tensor) applies. Check the delta first
    (:func:`check_delta`): positions are read as the blocks say."""
    positions: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    integer = _INTEGER_OF_SIZE[torch.empty((), dtype=delta.dtype).element_size()]
    for block in delta.blocks:
        n = _block_size(delta.numel, block.index)
        positions.append(_offsets(block, n) + block.index * BLOCK_ELEMENTS)
        values.append(_values(block, n, delta.dtype).view(integer))
    if not positions:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=integer)
    return torch.cat(positions), torch.cat(values)


def delta_of_changes(
    numel: int, dtype: torch.dtype, positions: torch.Tensor, new_bits: torch.Tensor
) -> TensorDelta:
    """The delta that writes ``new_bits`` (integers of the element size) at flat ``positions``
    (strictly increasing) of a tensor of ``numel`` elements of ``dtype``, each block in the
    smallest encoding that names only those elements (positions or a bitmask; dense only when
    every element of the block changes): a delta rebuilt from changes without the new
    version's other values (a sharded target passing on the regions it received)."""
    size = torch.empty((), dtype=dtype).element_size()
    blocks: list[DeltaBlock] = []
    at = 0
    for index, n, offsets in _changed_blocks(positions, numel):
        count = offsets.numel()
        block = torch.zeros(n, dtype=dtype)
        block.view(new_bits.dtype)[offsets] = new_bits[at : at + count]
        at += count
        kinds = [BlockKind.POSITIONS, BlockKind.BITMASK] + ([BlockKind.DENSE] if count == n else [])
        kind = min(kinds, key=lambda k: (encoded_bytes(k, n, count, size), k))
        blocks.append(_encode_block(index, kind, offsets, block))
    return TensorDelta(numel, dtype, tuple(blocks))
