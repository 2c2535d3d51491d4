"""docs/vllm.md: a worker on ``VLLMAsyncBackend`` (region ``stream``), and vLLM's native
weight-transfer API guarded in-process (region ``in_process``).

Fill-ins, outside the regions: a tiny random Llama (float32) for the policy checkpoint, a
stand-in for the P2R transfer that draws new random weights, and a transformers copy of the
model as the trainer's. Each part starts one engine and checks what it claims.
"""

# ruff: noqa: E402, F811 - fill-ins come before each region, and each region imports what it uses

import os

# A shared machine: vLLM's OpenMP threads are not pinned to cores. And one process fewer per
# engine (the engine core still runs in a process of its own).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import tempfile

import torch

from rollout_sync.testing import build_tiny_llama, greedy_reference, random_llama_weights


class RandomVersions:
    """A P2R transfer's receiving side, standing in: each ``receive`` fills ``into`` with the
    next version's random weights (seeded ``seed + version``)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
        self.shapes, self.seed, self.version = shapes, seed, 0
        self.sent: dict[int, dict[str, torch.Tensor]] = {}

    def receive(self, into: dict[str, torch.Tensor]) -> None:
        self.version += 1
        weights = random_llama_weights(self.shapes, seed=self.seed + self.version)
        for name, tensor in into.items():
            tensor.copy_(weights[name])
        self.sent[self.version] = weights


if __name__ == "__main__":
    workdir = tempfile.TemporaryDirectory()
    model_dir = workdir.name
    initial = build_tiny_llama(model_dir, seed=0)
    p2r = RandomVersions({name: tuple(t.shape) for name, t in initial.items()}, seed=100)

# [doc:stream]
from rollout_sync import weight_sync_handler
from rollout_sync.backends.vllm import VLLMAsyncBackend, VLLMEngineConfig, greedy_params


class Worker:
    def __init__(self, model_dir, p2r):
        self.rollout = VLLMAsyncBackend(
            VLLMEngineConfig(model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20)
        )
        self.p2r = p2r  # e.g. a WeightTransfer: receive(into) fills `into`

    @weight_sync_handler  # pause -> hold egress -> body -> fence -> resume
    def receive_weights(self, version):
        self.rollout.ensure_initialized()  # lazy start, inside the bracket: starts parked
        buffers = self.rollout.served_weights()  # receive into these (names/shapes/dtypes)
        self.p2r.receive(buffers)  # the transfer fills `buffers`
        self.rollout.load_weights(buffers)  # validate, write in the engine, read back
        self.rollout.commit_weight_version(version)


# Required in a script: vLLM starts its engine core in a new process, which imports this file.
if __name__ == "__main__":
    worker = Worker(model_dir, p2r)
    worker.receive_weights(1)  # the first sync starts the engine
    request = worker.rollout.submit([1, 2, 3], greedy_params(256))  # returns at once
    request.wait_for_tokens(16, timeout=60)
    worker.receive_weights(2)  # mid-generation: parks at a step boundary
    result = request.result(timeout=60)  # .token_ids, .admitted_version, .completed_version
    versions = result.token_weight_versions  # the weight version that produced each token
    worker.rollout.shutdown()
    # [/doc:stream]
    assert result.ok and len(result.token_ids) == 256, result
    split = versions.index(2)
    assert split >= 16 and versions == (1,) * split + (2,) * (256 - split), versions
    assert (result.admitted_version, result.completed_version) == (1, 2) and result.straddled
    # Token for token: version 1's greedy continuation up to the pause, then exactly version 2's
    # continuation of the tokens so far (the default KV policy recomputes the cache).
    reference = greedy_reference(model_dir)
    tokens = list(result.token_ids)
    assert tokens[:split] == reference(p2r.sent[1], [1, 2, 3], split)
    assert tokens[split:] == reference(p2r.sent[2], [1, 2, 3, *tokens[:split]], 256 - split)
    print(f"stream: tokens 0..{split - 1} from version 1, {split}..255 from version 2")

    # The trainer's model for the next part: the checkpoint's architecture, new weights.
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(random_llama_weights(dict(p2r.shapes), seed=7))

# [doc:in_process]
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from rollout_sync.backends.vllm import VLLMAsyncBackend, VLLMEngineConfig
from rollout_sync.backends.vllm.client import GuardedWeightSyncClient
from rollout_sync.backends.vllm.trainer import RolloutSyncTrainerInitInfo

if __name__ == "__main__":
    # The trainer's dtype: "auto" serves this float32 checkpoint as bfloat16 on CPU, and the
    # trainer's float32 update is then refused whole (a dtype problem for every tensor).
    config = VLLMEngineConfig(model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20)
    backend = VLLMAsyncBackend(config)  # runs the "rollout_sync" weight-transfer engine
    client = GuardedWeightSyncClient(backend.weight_sync_client(), rollout=backend)
    info = RolloutSyncTrainerInitInfo.on_this_host()  # trainer rank 0, a free local port
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )
    engine.send_weights(1)  # pause, hold, validated transfer, read-back, version, resume
    print(engine.metrics())  # weight_sync_time_ms, ... (harvested without a host stall)
    # [/doc:in_process]
    try:
        assert client.reports[-1].error is None and backend.weight_version == 1
        prompt = [1, 5, 9, 33, 7]
        [generated] = backend.generate([prompt], greedy_params(16), timeout=60)
        expected = reference(model.state_dict(), prompt, 16)
        assert list(generated.token_ids) == expected, (generated.token_ids, expected)
        print("in_process: the engine generates exactly what the trainer's weights do")
    finally:
        engine.shutdown()
        backend.shutdown()
        workdir.cleanup()
