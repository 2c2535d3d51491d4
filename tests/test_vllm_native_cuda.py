"""vLLM's built-in ``nccl`` weight-transfer engine through ``GuardedWeightSyncClient`` (CUDA).

vLLM for CPU cannot run it ("Cannot access accelerator device"): this test skips cleanly
without CUDA and a CUDA build of vLLM. The guard wraps vLLM's engines the same way as this
package's: a request in flight across the update continues on exactly the new weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm_helpers import NO_FORWARD_DURING  # noqa: F401 - first: sets vLLM's environment

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.timeout(600)
def test_vllms_nccl_engine_through_the_guard(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from rollout_sync.backends.vllm import VLLMAsyncBackend, VLLMEngineConfig, greedy_params
    from rollout_sync.backends.vllm.client import GuardedWeightSyncClient
    from rollout_sync.testing import (
        build_tiny_llama,
        find_free_port,
        greedy_reference,
        random_llama_weights,
    )

    initial = build_tiny_llama(tmp_path, seed=3)
    backend = VLLMAsyncBackend(
        VLLMEngineConfig(tmp_path, dtype="float32", weight_transfer_config={"backend": "nccl"})
    )
    import transformers

    with backend:
        model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        model = model.cuda()
        new = random_llama_weights({n: tuple(t.shape) for n, t in initial.items()}, seed=4)
        model.load_state_dict(new)
        client = GuardedWeightSyncClient(backend.weight_sync_client(), rollout=backend)
        engine = WeightTransferTrainerFactory.trainer_init(
            NCCLTrainerInitInfo(
                master_address="127.0.0.1", master_port=find_free_port(), world_size=2, rank=0
            ),
            client=client,
            source=ModuleSource(model),
        )
        prompt = [1, 5, 9]
        request = backend.submit(prompt, greedy_params(200))
        request.wait_for_tokens(8, timeout=60)
        engine.send_weights()
        assert request.result(timeout=120).ok
        assert client.reports and client.reports[-1].error is None
        out = backend.generate([prompt], greedy_params(16), timeout=60)[0]
        assert list(out.token_ids) == greedy_reference(tmp_path)(new, prompt, 16)
