"""The ``rollout-sync`` command and its demos. Nothing outside this package imports it.

* :mod:`.cli` - ``rollout-sync demo``: picks a demo from its options and prints the report.
* :mod:`.distributed` - the main job: a trainer and rollout replicas as processes over gloo on
  loopback (the tiny torch LM streaming, real payloads, real transfers).
* :mod:`.in_process` - the threads-only variant (``--in-process``).
* :mod:`.stream` - the tiny LM in one process (``--in-process --backend torch_lm``).
* :mod:`.vllm` - a tiny Llama on vLLM in one process (``--backend vllm``).
"""
