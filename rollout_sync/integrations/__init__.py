"""Other frameworks' protocols, driven by this package's guard.

* :mod:`.cosmos_rl` - cosmos-rl 0.4.7: the guard installed on its own rollout worker, scheduler,
  weight-sync thread and payload producer (:mod:`.cosmos_rl_payload`).
* :mod:`.fast_llm` - a Fast-LLM trainer's weight stream (its wire protocol in
  :mod:`.fast_llm_wire`) received by guarded replicas.

Placing our own job (torchrun, Ray) is :mod:`rollout_sync.launch`; the old paths
``rollout_sync.integrations.launch`` and ``rollout_sync.integrations.ray`` warn, until 0.3.0.
"""
