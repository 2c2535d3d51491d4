"""Rollout engines behind :class:`~rollout_sync.RolloutBase`.

Each backend lives in its own module and imports its engine lazily, so ``import rollout_sync``
works without any engine installed; the public names are re-exported by ``rollout_sync``.

* :mod:`rollout_sync.backends.vllm` - vLLM (``pip install 'rollout-sync[vllm]'``), with its
  engine-side worker extension in :mod:`rollout_sync.backends.vllm_worker`.
"""
