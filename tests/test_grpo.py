"""GRPO: group-relative advantages and the loss against hand-computed values, the weight sync to
a rollout actor, and a run killed and resumed to the uninterrupted run's losses, bitwise."""

import json
import math

import pytest
import torch
from test_export import make_checkpoint

from lmfoundry.train import grpo


def test_advantages_are_relative_to_the_group_and_zero_when_it_agrees():
    adv = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    std = math.sqrt(1 / 3)  # unbiased, of [1, 0, 0, 1]
    a = 0.5 / (std + 1e-4)
    assert adv[0].tolist() == pytest.approx([a, -a, -a, a])
    assert adv[1].tolist() == [0.0] * 4


def test_the_loss_and_its_gradient_equal_a_hand_computed_example():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0], [-0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = grpo.grpo_loss(logp, logp.detach(), ref, torch.tensor([1.0, -1.0]), mask, beta=0.1, clip_eps=0.2)
    kl = math.exp(-0.5) + 0.5 - 1  # the k3 estimate at the one token where policy and reference differ
    assert loss.item() == pytest.approx(((-1 + 0.1 * kl - 1) / 2 + 1) / 2, abs=1e-6)  # float32
    assert stats["kl"] == pytest.approx(kl / 2 / 2) and stats["clip_fraction"] == 0.0
    loss.backward()
    # d/dlogp of -ratio * A is -A (ratio 1); of the k3 term, beta * (1 - exp(ref - logp))
    assert logp.grad[0, 0].item() == pytest.approx((-1 + 0.1 * (1 - math.exp(-0.5))) / 2 / 2)
    assert logp.grad[1, 0].item() == pytest.approx(1 / 1 / 2) and logp.grad[1, 1].item() == 0.0
    # the clip: a ratio beyond 1 + eps with a positive advantage earns no more than 1 + eps
    high = torch.tensor([[0.0]])
    loss, stats = grpo.grpo_loss(high, torch.tensor([[-1.0]]), high, torch.tensor([1.0]), torch.ones(1, 1), 0.0, 0.2)
    assert loss.item() == pytest.approx(-1.2) and stats["clip_fraction"] == 1.0


def test_rl_settings_that_cannot_work_are_refused():
    base = dict(checkpoint="c", problems="p", output="o")
    with pytest.raises(ValueError, match="ZeRO-2"):
        grpo.RLConfig(**base, parallelism={"zero_stage": 3})
    with pytest.raises(ValueError, match="needs a reward_model"):
        grpo.RLConfig(**base, reward_model_weight=0.5)
    with pytest.raises(ValueError, match="global_batch_size=6 must be a multiple"):
        grpo.RLConfig(**base, batch={"micro_batch_size": 2, "global_batch_size": 6})


def test_a_rollout_actor_samples_from_the_weights_it_was_sent(ray_local, tmp_path):
    import ray
    from tokenizers import Tokenizer

    from lmfoundry.model.checkpoint import load_model_files
    from lmfoundry.model.tokenizer import SpecialTokens

    make_checkpoint(tmp_path / "ckpt")
    start = str(tmp_path / "ckpt")
    actor = ray.remote(grpo.RolloutWorker).remote(start)
    changed = load_model_files(start)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ray.get(actor.load.remote({k: v.clone() for k, v in changed.state_dict().items()}, 7))
    problems = [{"question": "Compute 2 + 3."}, {"question": "Solve for x: 2*x + 1 = 5"}]
    settings = {"group_size": 3, "max_tokens": 8, "temperature": 1.0}
    remote = ray.get(actor.rollouts.remote(problems, [11, 12], settings, 7))
    tokenizer = Tokenizer.from_file(f"{start}/tokenizer.json")
    special = SpecialTokens.of_checkpoint(start)
    torch.set_num_threads(1)  # as the actor runs
    local = grpo.rollouts(changed, tokenizer, special.eos_id(tokenizer), special.stop_ids(tokenizer), problems,
                          [11, 12], settings)  # fmt: skip
    assert remote == local
    original = grpo.rollouts(load_model_files(start), tokenizer, special.eos_id(tokenizer), special.stop_ids(tokenizer),
                             problems, [11, 12], settings)  # fmt: skip
    assert original != local  # the weights it was sent, not the ones it started with
    with pytest.raises(ray.exceptions.RayTaskError, match="version 8"):
        ray.get(actor.rollouts.remote(problems, [11, 12], settings, 8))


def scoring_model(start: str, out) -> str:
    """A reward model checkpoint with a random head: scores that differ between samples, so that
    a policy that never verifies an answer still gets advantages to learn from."""
    import shutil

    from lmfoundry.model.checkpoint import save_model_files
    from lmfoundry.platform import checkpoint
    from lmfoundry.train.reward import reward_model

    shutil.copytree(start, out)
    model = reward_model(start)
    torch.manual_seed(0)
    torch.nn.init.normal_(model.lm_head.weight, std=1.0)
    save_model_files(model, out)
    checkpoint.seal(out, {"step": 0})
    return str(out)


def test_grpo_killed_and_resumed_equals_the_uninterrupted_run_bitwise(deepspeed_workers, pretrained, tmp_path):
    from lmfoundry.align import synth
    from lmfoundry.platform import checkpoint

    synth.run_synth(synth.SynthConfig(output=str(tmp_path / "problems"), kinds={"arithmetic": 8, "algebra": 8}))
    settings = dict(
        checkpoint=pretrained[0],
        problems=str(tmp_path / "problems"),
        reward_model=scoring_model(checkpoint.resolve(pretrained[0]), tmp_path / "rm"),
        reward_model_weight=1.0,
        group_size=4,
        max_tokens=12,
        optimizer={"lr": 1e-3},
        schedule={"warmup_steps": 1, "max_steps": 4},
        batch={"micro_batch_size": 1, "global_batch_size": 2},
        parallelism={"num_workers": 2, "cpus_per_worker": 0.5},
        checkpointing={"every": 2},
        logging={"every": 1},
    )
    clean = grpo.run_grpo(grpo.RLConfig(**settings, output=str(tmp_path / "clean")))
    drilled = grpo.run_grpo(
        grpo.RLConfig(
            **settings, output=str(tmp_path / "drilled"), drills=[{"at_step": 3, "rank": 1}], health={"max_failures": 1}
        )
    )
    rows = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("clean", "drilled")
    }
    assert list((tmp_path / "drilled" / "_drills").iterdir())  # a worker was killed and the group restarted
    assert [r["step"] for r in rows["drilled"]] == [1, 2, 3, 4]
    for key in ("loss", "reward", "kl", "response_length"):
        assert [r[key] for r in rows["drilled"]] == [r[key] for r in rows["clean"]], key
    assert drilled["final_loss"] == clean["final_loss"] and clean["steps"] == 4
    assert rows["clean"][0]["kl"] == 0.0 < rows["clean"][-1]["kl"]  # the policy moved away from the reference
    assert all(r["grad_norm"] > 0 for r in rows["clean"])  # the advantages are not all zero
