"""Reinforcement learning from verifiable rewards: GRPO (Shao et al., 2024) on Ray Train +
DeepSpeed, with rollouts from the policy's current weights.

Each optimizer step takes a global batch of problems; for each, the policy samples a group of G
solutions (`group_size`), the verifier rates them (1 when the final answer verifies, else 0; plus
`reward_model_weight` times an outcome reward model's score when one is named), and each
solution's advantage is its reward relative to its group: (r - mean) / (std + 1e-4). The loss,
per solution averaged over its tokens, then over solutions:

    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + beta * KL(policy || reference)

with ratio = pi / pi_old and the KL estimated per token as exp(ref - logp) - (ref - logp) - 1
(the k3 estimator GRPO uses). One update per batch of rollouts, as TRL's default
(`num_iterations=1`): pi_old is the policy that sampled, so the ratio is 1 and the clip guards
nothing yet; it is kept so that the objective is GRPO's.

Rollouts are generated where `rollout_workers` says: 0, by each learner on its own share
(colocated, on the weights it trains); N > 0, by a pool of N Ray actors, to which rank 0 sends the
weights through the object store before each step's rollouts (the weight sync). Samples are
seeded by (seed, epoch, batch, problem, sample), so a resumed run draws the rollouts the
interrupted one would have, and its losses equal it bitwise.

GRPO is an objective of the one training loop (train/skeleton.py): checkpoints, exact resume,
drills, the evaluation gate (jobs/rl.py).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from pydantic import Field, model_validator

from lmfoundry.model.checkpoint import MODEL_CONFIG, TOKENIZER, load_model_files
from lmfoundry.model.generate import sample_groups
from lmfoundry.model.tokenizer import SpecialTokens
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.log import get_logger
from lmfoundry.reasoning import verifiers
from lmfoundry.train import skeleton
from lmfoundry.train.config import RewardBatchConfig, TrainStageConfig
from lmfoundry.train.dpo import DPOCheckpointingConfig, DPOOptimizerConfig, DPOScheduleConfig
from lmfoundry.train.engine import check_every_world_size
from lmfoundry.train.launch import open_run_dir, train_on_ray, worker_config
from lmfoundry.train.pretrain import start_texts

logger = get_logger(__name__)


class RLConfig(TrainStageConfig):
    checkpoint: str = Field(..., description="the starting policy (and KL reference): a checkpoint or a run directory")
    problems: str = Field(..., description="a synth output (kept.jsonl) or JSONL of arithmetic/algebra samples")
    group_size: int = Field(8, ge=2, le=256, description="solutions sampled per problem (G)")
    max_tokens: int = Field(64, ge=1, le=4096, description="tokens per solution")
    temperature: float = Field(1.0, gt=0, le=2)
    beta: float = Field(0.04, ge=0, description="weight of the KL to the reference")
    clip_eps: float = Field(0.2, gt=0, lt=1)
    reward_model: str | None = Field(None, description="an outcome reward model checkpoint, added to the verifier")
    reward_model_weight: float = Field(0.0, ge=0)
    rollout_workers: int = Field(0, ge=0, le=64, description="0: each learner samples; N: a pool of N Ray actors")
    rollout_cpus: float = Field(1.0, gt=0, description="CPUs of each rollout actor")
    batch: RewardBatchConfig = RewardBatchConfig(micro_batch_size=2, global_batch_size=4)  # problems
    optimizer: DPOOptimizerConfig = DPOOptimizerConfig(lr=1e-5)
    schedule: DPOScheduleConfig = DPOScheduleConfig()
    checkpointing: DPOCheckpointingConfig = DPOCheckpointingConfig()

    @model_validator(mode="after")
    def _check(self):
        self.batch.accumulation(self.parallelism.num_workers)
        if self.parallelism.zero_stage > 2:
            raise ValueError("parallelism.zero_stage: GRPO samples from the learner's weights, whole up to ZeRO-2")
        if self.parallelism.expert_parallel_size > 1:
            raise ValueError("parallelism.expert_parallel_size: GRPO trains without expert parallelism")
        if self.reward_model_weight and not self.reward_model:
            raise ValueError("reward_model_weight needs a reward_model")
        return self


# --- the algorithm ---------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards (P, G) -> each reward relative to its group (0 for a group that all agree)."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + 1e-4)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    clip_eps: float,
) -> tuple[torch.Tensor, dict]:
    """Token log-probabilities (N, L) of N sampled solutions under the policy, the sampling policy
    and the reference; advantages (N,); mask (N, L) over the solutions' tokens."""
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None]
    surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    per_token = -surrogate + beta * kl
    lengths = mask.sum(dim=1).clamp(min=1)
    loss = ((per_token * mask).sum(dim=1) / lengths).mean()
    kl_mean = float(((kl * mask).sum(dim=1) / lengths).mean())
    clipped = float((((ratio - 1).abs() > clip_eps).float() * mask).sum() / mask.sum().clamp(min=1))
    return loss, {"kl": kl_mean, "clip_fraction": clipped}


def token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """(N, T-1) log-probability of each token after the one before it."""
    logits, _ = model(ids[:, :-1])
    return torch.log_softmax(logits.float(), dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)


def read_problems(uri: str) -> list[dict]:
    rows = [r for _, r in storage.numbered_jsonl(_kept(uri))]
    problems = [
        r for r in rows if isinstance(r, dict) and r.get("kind") in ("arithmetic", "algebra") and "question" in r
    ]
    if not problems:
        raise ValueError(f"{uri} holds no arithmetic or algebra problems (a synth output's kept.jsonl)")
    return problems


def _kept(uri: str) -> str:
    uri = storage.normalize(uri)
    return uri if uri.endswith(".jsonl") else storage.join(uri, "kept.jsonl")


def sample_seed(seed: int, epoch: int, index: int, problem: int) -> int:
    return random.Random(f"{seed}/{epoch}/{index}/{problem}").getrandbits(31)


def rollouts(model, tokenizer, eos: int, stop_ids, problems: list[dict], seeds: list[int], cfg_dict: dict) -> list:
    """For each problem: (prompt ids, [solution ids] x G), every group decoded in one batch. Runs
    on a learner or a rollout actor."""
    g = cfg_dict["group_size"]
    prompts = [
        tokenizer.encode(p["question"] + verifiers.STEP_DELIMITER, add_special_tokens=False).ids or [eos]
        for p in problems
    ]
    groups = sample_groups(
        model,
        prompts,
        g,
        cfg_dict["max_tokens"],
        cfg_dict["temperature"],
        [[seed + j for j in range(g)] for seed in seeds],
        stop_ids,
    )
    return [(prompt, [gen.tokens for gen in gens]) for prompt, gens in zip(prompts, groups)]


class RolloutWorker:
    """A Ray actor that samples rollouts from the weights it was last sent."""

    def __init__(self, start_dir: str):
        from tokenizers import Tokenizer

        torch.set_num_threads(1)
        self.model = load_model_files(start_dir).eval()
        self.tokenizer = Tokenizer.from_file(str(Path(start_dir) / TOKENIZER))
        special = SpecialTokens.of_checkpoint(start_dir)
        self.eos, self.stop_ids = special.eos_id(self.tokenizer), special.stop_ids(self.tokenizer)
        self.version = -1

    def load(self, state: dict, version: int) -> int:
        self.model.load_state_dict(state)
        self.version = version
        return version

    @torch.no_grad()
    def rollouts(self, problems: list[dict], seeds: list[int], cfg_dict: dict, version: int) -> list:
        if version != self.version:
            raise RuntimeError(f"rollouts asked of weights version {version}, but this actor holds {self.version}")
        return rollouts(self.model, self.tokenizer, self.eos, self.stop_ids, problems, seeds, cfg_dict)


# --- the objective ------------------------------------------------------------------------------


class GRPOObjective:
    kind = "grpo"
    adapter = None  # trains every weight
    initial_values = None  # built whole
    report = None  # its held-out accuracy is measured by the driver (jobs/rl.py)
    seq_len = 1  # the batch counts problems
    tokens_per_step = flops_per_token = None

    def __init__(self, cfg: RLConfig, start_dir: str, rank: int, world: int, pool: list | None = None):
        from tokenizers import Tokenizer

        self.cfg, self.rank, self.world, self.pool = cfg, rank, world, pool or []
        torch.manual_seed(cfg.seed)
        self.model = load_model_files(start_dir).train()
        self.num_params = self.model.num_params()
        self.reference = load_model_files(start_dir).eval().requires_grad_(False)
        self.tokenizer = Tokenizer.from_file(str(Path(start_dir) / TOKENIZER))
        special = SpecialTokens.of_checkpoint(start_dir)
        self.eos, self.stop_ids = special.eos_id(self.tokenizer), special.stop_ids(self.tokenizer)
        self.problems = read_problems(cfg.problems)
        self.scorer = None
        if cfg.reward_model:
            from lmfoundry.clients.reward import RewardScorer

            self.scorer = RewardScorer(checkpoint.resolve(cfg.reward_model))
        self.tokenizer_json = (Path(start_dir) / TOKENIZER).read_text()
        self.chat_template, self.special_tokens = start_texts(start_dir)  # an imported model keeps its own
        self.per_global = cfg.batch.micro_batch_size * world
        self.batches_per_epoch = len(self.problems) // self.per_global
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(self.problems)} problems are fewer than one global micro-batch "
                f"(micro_batch_size x workers = {self.per_global})"
            )
        self.device = None
        self.synced = None  # the optimizer step whose weights the rollout pool holds

    def attach(self, engine) -> None:
        self.device = engine.device
        self.reference.to(engine.device)

    def batches(self, epoch: int, skip: int):
        order = list(range(len(self.problems)))
        random.Random(self.cfg.seed * 100003 + epoch).shuffle(order)
        mbs = self.cfg.batch.micro_batch_size
        for index in range(skip, self.batches_per_epoch):
            chunk = order[index * self.per_global : (index + 1) * self.per_global]
            mine = chunk[self.rank * mbs : (self.rank + 1) * mbs]
            yield index, [(i, sample_seed(self.cfg.seed, epoch, index, i)) for i in mine]

    def _sync(self, engine) -> None:
        """Rank 0 sends the weights of this optimizer step to every rollout actor; all ranks wait."""
        import ray
        import torch.distributed as dist

        step = engine.global_steps
        if self.synced == step:
            return
        if self.rank == 0:
            state = {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items()}
            ref = ray.put(state)
            ray.get([actor.load.remote(ref, step) for actor in self.pool])
        dist.barrier()
        self.synced = step

    def _rollouts(self, engine, batch: list[tuple[int, int]]) -> list:
        problems = [self.problems[i] for i, _ in batch]
        seeds = [seed for _, seed in batch]
        settings = self.cfg.model_dump(include={"group_size", "max_tokens", "temperature"})
        if self.pool:
            import ray

            self._sync(engine)
            actor = self.pool[self.rank % len(self.pool)]
            return ray.get(actor.rollouts.remote(problems, seeds, settings, engine.global_steps))
        with torch.no_grad():
            return rollouts(engine.module, self.tokenizer, self.eos, self.stop_ids, problems, seeds, settings)

    def rewards(self, problem: dict, prompt: list[int], solutions: list[list[int]]) -> tuple[list[float], list[bool]]:
        texts = [self.tokenizer.decode(s) for s in solutions]
        right = []
        for text in texts:
            answer = verifiers.answer_of(text)
            right.append(answer is not None and verifiers.verify({**problem, "answer": answer}) is None)
        rewards = [float(r) for r in right]
        if self.scorer is not None and self.cfg.reward_model_weight:
            question = problem["question"] + verifiers.STEP_DELIMITER
            scores = self.scorer.score(question, texts)
            rewards = [r + self.cfg.reward_model_weight * s for r, s in zip(rewards, scores)]
        return rewards, right

    def loss(self, engine, batch: list[tuple[int, int]]) -> tuple[torch.Tensor, dict]:
        started = time.perf_counter()
        groups = self._rollouts(engine, batch)
        rollout_s = time.perf_counter() - started
        rows, masks, rewards, right, lengths = [], [], [], [], []
        for (i, _), (prompt, solutions) in zip(batch, groups):
            r, ok = self.rewards(self.problems[i], prompt, solutions)
            rewards.append(r)
            right += ok
            for s in solutions:
                body = s + [self.eos]  # the end of the solution is learned too
                rows.append(prompt + body)
                masks.append([0.0] * (len(prompt) - 1) + [1.0] * len(body))
                lengths.append(len(s))
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.eos, dtype=torch.long)
        mask = torch.zeros((len(rows), width - 1))
        for r, (row, m) in enumerate(zip(rows, masks)):
            ids[r, : len(row)] = torch.tensor(row)
            mask[r, : len(m)] = torch.tensor(m)
        ids, mask = ids.to(self.device), mask.to(self.device)
        advantages = group_advantages(torch.tensor(rewards)).reshape(-1).to(self.device)
        logp = token_logprobs(engine, ids)
        with torch.no_grad():
            ref = token_logprobs(self.reference, ids)
        loss, stats = grpo_loss(logp, logp.detach(), ref, advantages, mask, self.cfg.beta, self.cfg.clip_eps)
        stats.update(
            reward=float(torch.tensor(rewards).mean()),
            accuracy=sum(right) / len(right),
            response_length=sum(lengths) / len(lengths),
            # per micro-batch, for throughput: the rollout's time and generated tokens, and the
            # tokens the learner runs forward and backward (prompt and solution, no padding)
            rollout_s=rollout_s,
            rollout_tokens=float(sum(lengths)),
            learner_tokens=float(sum(map(len, rows))),
        )
        return loss, stats

    def describe(self, metrics: dict) -> str:
        return (
            f"reward {metrics['reward']:.3f} verified {metrics['accuracy']:.3f} "
            f"length {metrics['response_length']:.1f} kl {metrics['kl']:.4f}"
        )

    def train_state(self, step: int) -> dict:
        return {"kind": "grpo"}


def grpo_loop(loop_config: dict) -> None:
    """Ray Train's per-worker function."""
    cfg = RLConfig.model_validate(loop_config["cfg"])
    pool = loop_config.get("pool") or []
    skeleton.run(
        cfg,
        loop_config["run_dir"],
        lambda rank, world: GRPOObjective(cfg, loop_config["start_dir"], rank, world, pool),
    )


# --- the driver -------------------------------------------------------------------------------


def start_pool(cfg: RLConfig, start_dir: str) -> list:
    import ray

    actor = ray.remote(num_cpus=cfg.rollout_cpus)(RolloutWorker)
    return [actor.remote(start_dir) for _ in range(cfg.rollout_workers)]


def run_grpo(cfg: RLConfig) -> dict:
    import ray

    start_uri = checkpoint.resolve(cfg.checkpoint)
    start_dir = checkpoint.local_copy(start_uri, model_only=True)
    pool = []
    try:
        checkpoint.verify(start_dir, model_only=True)
        problems = read_problems(cfg.problems)  # fail now on a bad file, not inside the workers
        json.loads((Path(start_dir) / MODEL_CONFIG).read_text())
        check_every_world_size(cfg, seq_len=1)
        out, done = open_run_dir(cfg, "rl")
        if done:
            return done
        started = time.time()
        pool = start_pool(cfg, start_dir)
        loop_config = {
            "cfg": worker_config(cfg, "problems", "reward_model"),
            "start_dir": start_dir,
            "run_dir": out,
            "pool": pool,
        }
        _, final, state = train_on_ray(grpo_loop, loop_config, cfg, out, "GRPO")
        history = state["history"]
        return storage.commit(
            out,
            "rl",
            {
                "start_checkpoint": start_uri,
                "problems": len(problems),
                "final_checkpoint": final,
                "steps": state["step"],
                "rollout_workers": cfg.rollout_workers,
                "first": {k: history[0].get(k) for k in ("loss", "reward", "accuracy", "response_length", "kl")},
                "last": {k: history[-1].get(k) for k in ("loss", "reward", "accuracy", "response_length", "kl")},
                "first_loss": history[0]["loss"],
                "final_loss": history[-1]["loss"],
                "seconds": round(time.time() - started, 2),
            },
        )
    finally:
        for actor in pool:
            ray.kill(actor)
        checkpoint.remove_copy(start_dir, start_uri)
