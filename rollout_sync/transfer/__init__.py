"""Weight transfer over torch.distributed: P2R and R2R as one validated, bucketed broadcast.

Both commands are the same operation on different groups. **P2R** is a broadcast from the
trainer to a rollout replica (the group ``{trainer, replica}``); **R2R** is a broadcast from the
replica that received to the other replicas of its group. :class:`WeightTransfer` does either,
for gloo (CPU tensors) and NCCL (CUDA tensors) alike: a manifest every rank votes on before
anything is written, buckets with optional checksums, and a commit vote. A replica that passes
the weights on relays them bucket by bucket as they arrive, so the two hops overlap.

* :mod:`.manifest` - what a version is made of: :class:`WeightManifest` (its layout into
  buckets, encoded and checked), :class:`ManifestEntry`, :func:`bucket_checksum`,
  :class:`OriginChecksums`, :func:`named_weights`.
* :mod:`.config` - what a caller chooses and gets back: :class:`TransferConfig`,
  :class:`TransferHooks`, :class:`TransferStats`, :data:`BUFFER_WRITE`.
* :mod:`.weight_transfer` - :class:`WeightTransfer`, moving a version over a process group:
  send, receive and stream, and :class:`StepwiseSend` (a send a bucket at a time). Its parts
  are private modules: ``_collectives`` (bounded collectives, the votes, the manifest's
  broadcast and the abort header), ``_buckets`` (zero-copy spans, staging buffers, views),
  ``_receiving`` (a receiver's manifest, buckets, commit vote and failures), ``_delta_receive``
  (a delta's receive: proven, applied or kept pending, restored on failure), ``_relay``
  (:meth:`WeightTransfer.relay`, the pipelined relay).
* ``_pipeline`` - buckets in flight: the in-order collective queue, and the relay's second hop
  (private).
* ``_barrier`` - the P2R barrier's wire format: a manifest-shaped header and a vote, so that a
  barrier only one side takes is caught (private; ``SyncGroups.p2r_barrier`` uses it).
"""

from ..errors import ChecksumMismatchError as ChecksumMismatchError
from ..errors import ManifestError as ManifestError
from ..errors import ManifestRejected as ManifestRejected
from ..errors import RelayForwardError as RelayForwardError
from ..errors import TransferPlanMismatch as TransferPlanMismatch
from ..errors import WeightTransferError as WeightTransferError
from ..errors import WeightTransferTimeout as WeightTransferTimeout
from ..flat import ALIGN_BYTES as ALIGN_BYTES
from .config import BUFFER_WRITE as BUFFER_WRITE
from .config import TransferConfig as TransferConfig
from .config import TransferHooks as TransferHooks
from .config import TransferStats as TransferStats
from .layout import Layout as Layout
from .layout import LocalTensor as LocalTensor
from .layout import Piece as Piece
from .manifest import ManifestEntry as ManifestEntry
from .manifest import OriginChecksums as OriginChecksums
from .manifest import WeightManifest as WeightManifest
from .manifest import bucket_checksum as bucket_checksum
from .manifest import named_weights as named_weights
from .plan import Move as Move
from .plan import TransferPlan as TransferPlan
from .sharded import ShardedTransfer as ShardedTransfer
from .weight_transfer import StepwiseSend as StepwiseSend
from .weight_transfer import WeightTransfer as WeightTransfer

__all__ = [
    "BUFFER_WRITE",
    "ChecksumMismatchError",
    "Layout",
    "LocalTensor",
    "ManifestEntry",
    "ManifestError",
    "ManifestRejected",
    "Move",
    "OriginChecksums",
    "Piece",
    "RelayForwardError",
    "ShardedTransfer",
    "StepwiseSend",
    "TransferConfig",
    "TransferHooks",
    "TransferPlan",
    "TransferPlanMismatch",
    "TransferStats",
    "WeightManifest",
    "WeightTransfer",
    "WeightTransferError",
    "WeightTransferTimeout",
    "bucket_checksum",
    "named_weights",
]
