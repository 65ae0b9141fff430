"""The rollout phases: generate → rewards → dynamic-sampling filter (with over-sampling).

:meth:`RolloutPhase.collect` produces one step's :class:`RolloutBatch`: it draws prompts from the
checkpointed sampler, asks the engines for ``n_samples_per_prompt`` responses each (one HTTP request
per prompt, a progress bar over requests), scores them in the reward workers and — with dynamic
sampling — drops the groups whose rewards are all equal (they carry no GRPO signal), drawing more
prompts for up to ``max_oversample_rounds`` refill rounds. The batch is then cut to
``prompts_per_step`` groups and to a size the data-parallel ranks and micro-batches divide; when no
group survives, the batch carries a ``skipped`` reason instead of crashing the trainer on an empty batch.

Reproducibility: request seeds are a pure function of ``(run seed, step, round, slot)``, so the same
step of a resumed run samples the same tokens as the uninterrupted run (``rollout.seeded``).
"""

from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_rl.config import RolloutConfig
from megatron_rl.data.prompts import PromptRecord
from megatron_rl.data.rewards.runner import FAILURE_KINDS, RewardRunner
from megatron_rl.data.sampler import PromptSampler
from megatron_rl.diagnostics import reward_entropy_bits
from megatron_rl.metrics import progress
from megatron_rl.orchestration.activity import BusyMeter
from megatron_rl.rollout.client.mask_overflow import overflowed
from megatron_rl.rollout.client.protocol import GenerateRequest, RolloutEngine, Sample, SamplingParams
from megatron_rl.rollout.client.weight_versions import version_number


@dataclass
class Group:
    """The ``n`` samples of one prompt, their decoded text and rewards (``token_rewards``: per sample, the
    per-token rewards of a reward function that returned one per response token, else None; ``rewards``
    then holds their sums)."""

    record: PromptRecord
    samples: List[Sample]
    texts: List[str]
    rewards: List[float]
    failed: List[bool]
    token_rewards: Optional[List[Optional[Tuple[float, ...]]]] = None

    @property
    def outcomes(self) -> List[Any]:
        """Each sample's whole reward: its per-token sequence if it has one, else the scalar."""
        per_token = self.token_rewards or [None] * len(self.rewards)
        return [r if t is None else t for r, t in zip(self.rewards, per_token)]

    @property
    def all_equal(self) -> bool:
        return len(set(self.outcomes)) == 1


@dataclass
class RolloutBatch:
    """One step's training groups (after filtering) and the rollout's metrics; ``skipped`` says why
    there is nothing to train on."""

    step: int
    groups: List[Group]
    metrics: Dict[str, float] = field(default_factory=dict)
    skipped: Optional[str] = None

    @property
    def samples(self) -> List[Sample]:
        return [s for g in self.groups for s in g.samples]


def request_seed(seed: int, step: int, round_: int, slot: int) -> int:
    """A 63-bit seed per request: the same prompt slot of the same step always samples the same way."""
    state = np.random.SeedSequence([seed, step, round_, slot]).generate_state(2, np.uint32)
    return (int(state[0]) << 31 | int(state[1]) >> 1) & ((1 << 63) - 1)


class RolloutPhase:
    """Generation and scoring against ``engine`` (any :class:`RolloutEngine`, usually a RemoteEngine)."""

    def __init__(self, cfg: RolloutConfig, engine: RolloutEngine, tokenizer: Any, sampler: PromptSampler,
                 rewards: RewardRunner, *, seed: int, batch_unit: int, progress_bars: bool = True,
                 routing_replay: bool = False):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.sampler, self.rewards = sampler, rewards
        self.seed, self.batch_unit = seed, batch_unit
        self.progress_bars, self.routing_replay = progress_bars, routing_replay
        eos = set() if cfg.sampling.ignore_eos else {int(tokenizer.eos_token_id)}
        self.stop_ids = tuple(sorted(set(cfg.sampling.stop_token_ids) | eos))
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="rollout")
        self.meter = BusyMeter()  # the engines' busy time, for perf/engine_idle_frac

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def sampling(self, *, n: int, greedy: bool = False, max_new_tokens: Optional[int] = None,
                 seed: Optional[int] = None, record: Optional[PromptRecord] = None) -> SamplingParams:
        """``record``: a prompt whose ``max_new_tokens`` metadata column sets its own length (benchmarks)."""
        s = self.cfg.sampling
        if max_new_tokens is None and record is not None and record.metadata.get("max_new_tokens"):
            max_new_tokens = min(int(record.metadata["max_new_tokens"]), s.max_new_tokens)
        if greedy:
            return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens or s.max_new_tokens,
                                  stop_token_ids=self.stop_ids, n=n, seed=seed)
        return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                              max_new_tokens=max_new_tokens or s.max_new_tokens, stop_token_ids=self.stop_ids,
                              n=n, seed=seed, ignore_eos=s.ignore_eos)

    # ---- phases ---------------------------------------------------------------------------------------
    def generate(self, records: Sequence[PromptRecord], params: Sequence[SamplingParams],
                 desc: str = "rollout") -> List[List[Sample]]:
        """Each record's samples (one request per prompt, sent concurrently; a bar over requests)."""
        requests = [GenerateRequest(r.prompt_ids, p, return_routed_experts=self.routing_replay)
                    for r, p in zip(records, params)]
        out: List[Optional[List[Sample]]] = [None] * len(requests)
        futures = {self._pool.submit(self.engine.generate, [req]): i for i, req in enumerate(requests)}
        with progress(len(requests), desc, self.progress_bars, unit="req") as bar, self.meter.busy():
            for f in as_completed(futures):
                out[futures[f]] = f.result()
                bar.update(1)
        return out  # type: ignore[return-value]

    def score(self, records: Sequence[PromptRecord], samples: Sequence[List[Sample]]):
        """``(groups, reward stats)``: a failed reward (exception, timeout, non-finite) is counted, not raised."""
        texts = [[self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in group] for group in samples]
        flat_texts = [t for group in texts for t in group]
        labels = [r.label for r, group in zip(records, samples) for _ in group]
        infos = [dict(r.metadata, prompt=r.prompt_text, index=r.index, response_ids=list(s.response_ids))
                 for r, group in zip(records, samples) for s in group]
        result = self.rewards.compute_rewards(flat_texts, labels, infos)
        per_token = result.token_rewards
        if per_token is not None:
            for info, t in zip(infos, per_token):
                if t is not None and len(t) != len(info["response_ids"]):
                    raise ValueError(f"the reward function returned {len(t)} per-token rewards for a response of "
                                     f"{len(info['response_ids'])} tokens (sample_info['response_ids']); return one "
                                     "per response token, or a float")
        groups, k = [], 0
        for r, group, text in zip(records, samples, texts):
            n = len(group)
            groups.append(Group(r, group, text, result.rewards[k:k + n], result.failed[k:k + n],
                                None if per_token is None else per_token[k:k + n]))
            k += n
        return groups, result.stats

    def collect(self, step: int, *, filter_groups: bool) -> RolloutBatch:
        """The training groups of ``step`` (see the module docstring)."""
        cfg = self.cfg
        target, dynamic = cfg.prompts_per_step, cfg.dynamic_sampling and filter_groups
        kept: List[Group] = []
        generated: List[Group] = []
        times = {"rollout": 0.0, "reward": 0.0}
        failures = {k: 0.0 for k in FAILURE_KINDS}
        round_, wanted = 0, target
        while True:
            records = self.sampler.next_batch(wanted)
            params = [self.sampling(n=cfg.n_samples_per_prompt, record=r,
                                    seed=request_seed(self.seed, step, round_, i) if cfg.seeded else None)
                      for i, r in enumerate(records)]
            start = time.perf_counter()
            samples = self.generate(records, params, desc=f"rollout step {step}" + (f" +{round_}" if round_ else ""))
            times["rollout"] += time.perf_counter() - start
            start = time.perf_counter()
            groups, stats = self.score(records, samples)
            times["reward"] += time.perf_counter() - start
            for kind in FAILURE_KINDS:
                failures[kind] += stats.get(f"reward/failed_{kind}", 0.0)
            generated += groups
            kept += [g for g in groups if not (dynamic and g.all_equal)]
            if not dynamic or len(kept) >= target or round_ >= cfg.max_oversample_rounds:
                break
            round_ += 1
            wanted = math.ceil((target - len(kept)) * cfg.oversample_factor)
        kept = self.fit(kept[:target])
        metrics = rollout_metrics(generated, kept, round_, times, failures, step)
        skipped = None
        if not kept:
            rewards = [x for g in generated for x in g.rewards]
            skipped = (f"nothing to train on: {len(generated)} prompt groups in {round_ + 1} round(s) "
                       + ("all had equal rewards (dynamic sampling)" if dynamic else
                          f"do not fill one batch unit of {self.batch_unit} sequences")
                       + f"; mean reward {statistics.fmean(rewards):.3f}")
        return RolloutBatch(step, kept, metrics, skipped)

    def fit(self, groups: List[Group]) -> List[Group]:
        """Drop trailing groups until the sequence count divides into the data-parallel micro-batches."""
        n = self.cfg.n_samples_per_prompt
        k = len(groups)
        while k and (k * n) % self.batch_unit:
            k -= 1
        return groups[:k]


def rollout_metrics(generated: List[Group], kept: List[Group], rounds: int, times: Dict[str, float],
                    failures: Dict[str, float], step: int) -> Dict[str, float]:
    """A step's rollout metrics over the groups it generated (``generated``) and trains on (``kept``)."""
    rewards = [x for g in generated for x in g.rewards]
    samples = [s for g in generated for s in g.samples]
    lengths = [len(s.response_ids) for s in samples]
    out = {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/groups": float(len(generated)),
        "rollout/groups_kept": float(len(kept)),
        "rollout/groups_all_equal": float(sum(g.all_equal for g in generated)),
        "rollout/oversample_rounds": float(rounds),
        "rollout/response_len_mean": statistics.fmean(lengths),
        "rollout/response_len_max": float(max(lengths)),
        "rollout/truncated_frac": statistics.fmean(s.finish_reason == "length" for s in samples),
        "rollout/aborted": float(sum(s.finish_reason == "abort" for s in samples)),
        # groups SGLang refused over --sampling-mask-max-tokens even when sent again (rollout/client/mask_overflow.py)
        "rollout/sampling_mask_overflow": float(sum(overflowed(s) for s in samples)),
        "rollout/response_tokens": float(sum(lengths)),
        "reward/entropy_bits": reward_entropy_bits([g.outcomes for g in generated]),  # §i: bits per episode
        "rollout/prompt_tokens": float(sum(len(g.record.prompt_ids) * len(g.samples) for g in generated)),
        "rollout/seq_len_sq_sum": float(sum((len(g.record.prompt_ids) + len(s.response_ids)) ** 2
                                            for g in generated for s in g.samples)),  # attention FLOPs (MFU)
        "reward/failed": float(sum(sum(g.failed) for g in generated)),
        **{f"time/{k}": v for k, v in times.items()},
        # the freshest possible is step - 1 (the weights trained through the previous step): 0 when synchronous
        "rollout/staleness": statistics.fmean(step - 1 - version_number(s.weight_version) for s in samples),
    }
    out.update({f"reward/failed_{k}": v for k, v in failures.items()})
    if kept:
        out["batch/reward_mean"] = statistics.fmean(x for g in kept for x in g.rewards)
    return out
