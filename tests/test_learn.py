"""The learning loop (rollout_sync.learn, ``rollout-sync demo --learn``): the task's reward, the
rollouts as sent, staleness by version, truncated importance weights from the behaviour
log-probabilities that were sent, and a policy that measurably learns (and a frozen one that
does not, on the same seed)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from rollout_sync.backends.torch_lm import TinyLMConfig
from rollout_sync.demos.cli import main
from rollout_sync.learn import (
    InvalidRollout,
    LearnConfig,
    PolicyLearner,
    Rollout,
    RolloutGroups,
    TokenSetTask,
    group_advantages,
    rollout_from_payload,
    rollout_payload,
    sequence_logprobs,
    truncated_importance_loss,
)
from rollout_sync.learn.local import learn_in_process

TASK = TokenSetTask()


def _rollout(group: str, versions: list[int], tokens: tuple[int, ...] = (64, 65)) -> Rollout:
    n = len(versions)
    return Rollout(
        group,
        (0, 10, 11),
        tokens[:n] if len(tokens) >= n else tokens + (64,) * (n - len(tokens)),
        torch.full((n,), -1.0),
        torch.tensor(versions),
    )


def test_the_reward_is_the_share_of_completion_tokens_in_the_tasks_set() -> None:
    assert TASK.chance == 8 / 128
    assert list(TASK.targets(1)) == list(range(72, 80))
    assert TASK.reward((1, 9, 9), (72, 79, 3, 64)) == 0.5  # 64 is task 0's, not task 1's
    assert TASK.reward((0, 9, 9), ()) == 0.0
    prompt = TASK.prompt(random.Random(0))
    assert len(prompt) == TASK.prompt_length and 0 <= prompt[0] < TASK.tasks
    assert all(TASK.tasks <= t < TASK.first_target for t in prompt[1:])
    with pytest.raises(ValueError, match="task token"):
        TASK.reward((99, 1), (64,))
    with pytest.raises(ValueError, match="do not fit"):
        TokenSetTask(vocab_size=64)


def test_a_rollout_crosses_as_sent_and_an_inconsistent_one_is_refused() -> None:
    tensors, meta = rollout_payload("r1:0", (0, 5, 6), (64, 70), (-0.5, -2.0), (3, 4))
    rollout = rollout_from_payload(tensors, meta)
    assert rollout.group == "r1:0" and rollout.prompt == (0, 5, 6) and rollout.tokens == (64, 70)
    assert rollout.behaviour_logprobs.tolist() == [-0.5, -2.0]
    assert rollout.staleness(6) == 3  # by the oldest token
    bad = dict(tensors, logprobs=torch.tensor([-0.5]))
    with pytest.raises(InvalidRollout, match="one entry per token"):
        rollout_from_payload(bad, meta)
    with pytest.raises(InvalidRollout, match="finite and <= 0"):
        rollout_from_payload(dict(tensors, logprobs=torch.tensor([0.5, -1.0])), meta)
    with pytest.raises(InvalidRollout, match="missing"):
        rollout_from_payload(tensors, {})


def test_stale_sequences_are_dropped_by_their_oldest_tokens_version() -> None:
    groups = RolloutGroups(group_size=3, max_staleness=2)
    # Group a: one sequence has a token of version 5 (3 behind version 8): dropped alone.
    for versions in ([6, 7], [5, 8], [8, 8]):
        groups.add(_rollout("a", versions))
    # Group b: two of three too old, one left: nothing to compare with, the group goes.
    for versions in ([4, 4], [5, 6], [7, 7]):
        groups.add(_rollout("b", versions))
    groups.add(_rollout("c", [8, 8]))  # not whole: waits
    assert groups.whole == 2
    assert not groups.ready(2, trainer_version=8)
    taken = groups.take(2, trainer_version=8)
    assert [len(g) for g in taken.groups] == [2]
    assert sorted(taken.staleness) == [0, 2]
    assert groups.sequences_dropped == 4 and groups.tokens_dropped == 8


def test_importance_weights_are_the_truncated_ratio_to_the_behaviour_logprobs() -> None:
    current = torch.log(torch.tensor([[0.5, 0.2, 0.9]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    mask = torch.tensor([[True, True, True]])
    advantage = torch.tensor([1.5])
    out = truncated_importance_loss(current, behaviour, advantage, mask, cap=2.0)
    out.loss.backward()
    ratios = [2.0, 0.5, 9.0]
    assert out.ratios.tolist() == pytest.approx(ratios, rel=1e-5)
    assert out.clipped == 1
    weights = [min(r, 2.0) for r in ratios]
    assert current.grad is not None
    assert current.grad[0].tolist() == pytest.approx([-w * 1.5 / 3 for w in weights], rel=1e-5)
    current.grad = None
    plain = truncated_importance_loss(
        current, behaviour, advantage, mask, cap=2.0, importance_weights=False
    )
    plain.loss.backward()
    assert current.grad[0].tolist() == pytest.approx([-1.5 / 3] * 3, rel=1e-5)
    assert group_advantages(torch.tensor([1.0, 1.0])).tolist() == [0.0, 0.0]


def test_the_learner_weighs_by_the_behaviour_logprobs_it_was_sent() -> None:
    model = TinyLMConfig(dtype=torch.bfloat16, seed=3)
    learner = PolicyLearner(model, task=TASK, lr=1e-3)
    prompts = [(0, 9, 9)] * 2
    completions = [(64, 65, 1), (3, 4, 5)]
    current, _ = sequence_logprobs(learner.master, prompts, completions)
    behaviour = current.detach() - torch.tensor([[0.1, 0.2, 0.3], [-0.4, 0.0, 0.5]])
    group = [
        Rollout("g", p, c, behaviour[i].clone(), torch.zeros(3, dtype=torch.int64))
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]
    step = learner.step([group])
    expected = torch.tensor([[0.1, 0.2, 0.3], [-0.4, 0.0, 0.5]]).exp().flatten().tolist()
    assert step.ratios == pytest.approx(expected, rel=1e-4)
    assert step.reward == pytest.approx((2 / 3 + 0) / 2)
    # The served copy is the master, cast, and the step moved it.
    assert 0 < step.changed_fraction <= 1
    for name, param in learner.master.named_parameters():
        assert torch.equal(learner.served[name], param.detach().to(torch.bfloat16))


def test_the_learner_trains_a_transformers_llama_master_served_in_the_checkpoints_names() -> None:
    """The vLLM replicas' model: a float32 LlamaForCausalLM master behind CausalLMPolicy, its
    tokens' log-probabilities those of a plain forward, its served copy named like the
    checkpoint vLLM loads and cast to bf16."""
    pytest.importorskip("transformers")
    from rollout_sync.learn.models import CausalLMPolicy
    from rollout_sync.testing.tiny_llama import TINY_LLAMA, tiny_llama

    task = TokenSetTask(vocab_size=int(TINY_LLAMA["vocab_size"]))
    policy = CausalLMPolicy(tiny_llama(seed=0, std=0.02))
    learner = PolicyLearner(policy, task=task, lr=5e-3, temperature=0.5)
    prompts, completions = [(0, 9, 9), (1, 9, 9)], [(64, 65, 300), (72, 2, 1)]
    current, mask = sequence_logprobs(policy, prompts, completions, temperature=0.5)
    with torch.no_grad():
        logits = policy.module(torch.tensor([prompts[0] + completions[0]])).logits[0, 2:5]
    plain = torch.log_softmax(logits / 0.5, -1).gather(1, torch.tensor([[64], [65], [300]]))
    assert torch.allclose(current[0].detach(), plain.squeeze(1), atol=1e-5) and bool(mask.all())
    assert set(learner.served) == set(tiny_llama().state_dict())
    assert {t.dtype for t in learner.served.values()} == {torch.bfloat16}
    group = [
        Rollout("g", p, c, current[i].detach() - 0.1, torch.zeros(3, dtype=torch.int64))
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
    ]
    step = learner.step([group])
    assert step.reward == pytest.approx((2 / 3 + 1 / 3) / 2) and 0 < step.changed_fraction <= 1
    with pytest.raises(ValueError, match="master is float32"):
        CausalLMPolicy(tiny_llama().to(torch.bfloat16))


def test_a_policy_learns_the_task_and_a_frozen_one_on_the_same_seed_does_not() -> None:
    def learnt(lr: float) -> tuple[float, float]:
        history = learn_in_process(LearnConfig(lr=lr), 30, seed=0)
        rewards = [s.reward for s in history]
        return sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6

    def learns(first: float, last: float) -> bool:
        return last >= max(3 * TASK.chance, first + 0.2)

    first, last = learnt(3e-3)
    assert learns(first, last), (first, last)
    frozen_first, frozen_last = learnt(0.0)
    assert not learns(frozen_first, frozen_last), (frozen_first, frozen_last)


def test_a_next_token_step_at_a_realistic_lr_changes_few_served_elements() -> None:
    """`demo --delta`'s trainer step: AdamW on the fp32 master at lr 1e-6 moves every element
    a little, and only the few whose bf16 rounding flips change in the served copy (what a
    delta ships); the served copy is the master, cast. Bad tokens are refused, nothing
    stepped."""
    learner = PolicyLearner(TinyLMConfig(dtype=torch.bfloat16), task=TASK, lr=1e-6)
    before = {n: t.clone() for n, t in learner.served.items()}
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    step = learner.next_token_step(tokens)
    assert math.isfinite(step.loss) and step.tokens == 4 * 16
    assert 0 < step.changed_fraction < 0.05
    changed = sum(int((learner.served[n] != before[n]).sum()) for n in before)
    total = sum(t.numel() for t in before.values())
    assert changed / total == pytest.approx(step.changed_fraction)
    for name, param in learner.master.named_parameters():
        assert torch.equal(learner.served[name], param.detach().to(torch.bfloat16))
    stepped = {n: t.clone() for n, t in learner.served.items()}
    for bad, message in (
        (tokens[0], r"\[batch, width\]"),
        (tokens[:, :1], "2..256 tokens"),
        (tokens + 128, r"\[0, 128\)"),
    ):
        with pytest.raises(ValueError, match=message):
            learner.next_token_step(bad)
    assert all(torch.equal(learner.served[n], t) for n, t in stepped.items())


def test_demo_learn_learns_from_the_replicas_rollouts_in_flight(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """docs/learning.md's command, `demo --learn --staged --plot learn.png`: staged, in flight,
    over the payload transport; every check of the job holds, the reward climbs, the replicas
    kept generating through the steps (the synchronous loop idles them a third of the time),
    and the picture has the reward curve."""
    pytest.importorskip("matplotlib")
    picture = tmp_path / "learn.png"
    code = main(["demo", "--learn", "--staged", "--plot", str(picture), "--json"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0
    assert report["steps"] == 40 and report["sync_mode"] == "staged"
    assert report["torn_reads"] == 0 and report["bit_identical"] is True
    assert report["payloads_lost"] == 0 and report["failed_commands"] == 0
    assert report["reward_last"] >= max(3 * TASK.chance, report["reward_first"] + 0.2)
    assert len(report["reward_curve"]) == 40
    assert report["staleness_p99"] <= 4  # --max-staleness's default: what was older was dropped
    assert 0 < report["changed_fraction_p50"] <= 1
    assert report["replica_idle_fraction"] < 0.1  # in flight: parked only for the installs
    for key in ("importance_weight_p50", "importance_weight_p99", "clipped_fraction"):
        assert math.isfinite(report[key])
    assert picture.stat().st_size > 0 and f"plot: {picture}" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--learn", "--backend", "torn_read"],
            "torn_read has none: use --backend torch_lm or vllm",
        ),
        (["--learn", "--in-process"], "drop --in-process"),
        (["--learn", "--lora"], "drop --lora"),
        (["--learn", "--trainer-ranks", "2"], "one fp32 master on one rank"),
        (["--learn", "--mode", "async_per_generation"], "sync or staged"),
        (["--lr", "0.1"], "--lr needs --learn or --delta"),
        (["--learn", "--max-staleness", "-1"], "at least 0"),
    ],
)
def test_demo_learn_refuses_what_it_does_not_run(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["demo", *argv])
