"""Cross-field checks of a :class:`~megatron_rl.config.RunConfig`, run before anything starts.

Each section already validated itself when it was built; what is left needs several sections at once, or
that the paths they name exist. Every problem is collected; :mod:`megatron_rl.preflight` adds the checks that
read those files or need the training code (this package imports neither) and raises all of them together in
one :class:`~megatron_rl.config_io.ConfigError`, each naming the fields, their values and what would fix it —
a user fixes a recipe in one round trip instead of one error per launch.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import List, Optional

from megatron_rl.config.limits import limit_problems
from megatron_rl.config.run import RunConfig

logger = logging.getLogger(__name__)
_GROUPED = ("grpo", "rloo", "reinforce_pp_baseline", "otb")


def rule_problems(cfg: RunConfig, *, files: bool = True) -> List[str]:
    """Every problem of the rules across sections (and, unless ``files=False``, of paths that do not exist).
    What reads the files or needs the training code is :mod:`megatron_rl.preflight`'s, which adds its
    problems to these and raises them together."""
    problems: List[str] = limit_problems(cfg)
    for check in [_parallel, _batch, _rollout, _objective, _warmup, _eval, _profile] + ([_paths] if files else []):
        check(cfg, problems)
    _warn_uncorrected_async(cfg)
    return problems


def _profile(cfg: RunConfig, out: List[str]) -> None:
    p = cfg.profile
    late = [s for s in p.steps if s > cfg.steps]
    if late:
        out.append(f"profile.steps={p.steps}: step(s) {late} come after the last step (steps={cfg.steps}); "
                   "list steps in [1, steps]")
    ranks = [r for r in p.trainer_ranks if r >= cfg.parallel.world_size]
    if p.steps and ranks:
        out.append(f"profile.trainer_ranks={p.trainer_ranks}: rank(s) {ranks} do not exist with "
                   f"parallel.world_size={cfg.parallel.world_size}; use ranks in [0, {cfg.parallel.world_size - 1}]")


def _parallel(cfg: RunConfig, out: List[str]) -> None:
    p = cfg.parallel
    model = p.model_parallel
    if p.world_size % model:
        out.append(f"parallel.world_size={p.world_size} is not divisible by parallel.tp * parallel.pp * parallel.cp = "
                   f"{p.tp} * {p.pp} * {p.cp} = {model}; make world_size a multiple of {model} or change tp/pp/cp")
        return
    try:
        p.layout.check(p.world_size)
    except ValueError as e:
        out.append(f"parallel (world_size={p.world_size}, tp={p.tp}, pp={p.pp}, cp={p.cp}, ep={p.ep}, etp={p.etp}): "
                   f"{e}")


def batch_unit(cfg: RunConfig) -> int:
    """Sequences a step's batch must be a multiple of: every DP rank gets as many sequences, and (without a
    token budget) a whole number of micro-batches."""
    t = cfg.train
    return cfg.parallel.dp * (1 if t.token_budget else t.micro_batch_size)


def _batch(cfg: RunConfig, out: List[str]) -> None:
    p, r, t = cfg.parallel, cfg.rollout, cfg.train
    if p.world_size % p.model_parallel:
        return  # reported by _parallel
    unit = batch_unit(cfg)  # sequences a step must be a multiple of
    batch = r.prompts_per_step * r.n_samples_per_prompt
    if batch % unit:
        step = unit // math.gcd(unit, r.n_samples_per_prompt)
        what = ("data-parallel size" if t.token_budget else
                f"data-parallel size * train.micro_batch_size = {p.dp} * {t.micro_batch_size}")
        out.append(f"the train batch rollout.prompts_per_step * rollout.n_samples_per_prompt = {r.prompts_per_step} * "
                   f"{r.n_samples_per_prompt} = {batch} sequences is not divisible by {what} = {unit}; make "
                   f"prompts_per_step a multiple of {step}, or change train.micro_batch_size / parallel sizes")
    if cfg.advantage.estimator in _GROUPED and r.n_samples_per_prompt < 2:
        out.append(f"advantage.estimator={cfg.advantage.estimator!r} compares the samples of a prompt group but "
                   f"rollout.n_samples_per_prompt={r.n_samples_per_prompt}; use >= 2 samples (e.g. 8) or estimator "
                   "'reinforce_pp'")
    if r.dynamic_sampling and r.n_samples_per_prompt < 2:
        out.append("rollout.dynamic_sampling=true drops groups whose rewards are all equal, which every group of "
                   f"rollout.n_samples_per_prompt={r.n_samples_per_prompt} is; use >= 2 samples per prompt")


def _rollout(cfg: RunConfig, out: List[str]) -> None:
    """The rollout section's own problems, then the rules that read other sections too."""
    r, p = cfg.rollout, cfg.parallel
    out.extend(r.problems())
    if r.placement == "colocated" and r.engine == "embedded" and r.num_engines > p.world_size:
        out.append(f"rollout.num_engines={r.num_engines} colocated engines need as many trainer bundles, but "
                   f"parallel.world_size={p.world_size}; lower num_engines or use placement=disaggregated")
    if r.engine == "sglang":
        if r.placement == "colocated":
            _colocated_sglang(cfg, out)
        if r.placement == "disaggregated" and cfg.cluster.gpus_per_engine != r.sglang.tp_size:
            out.append(f"cluster.gpus_per_engine={cfg.cluster.gpus_per_engine} but each SGLang server uses "
                       f"rollout.sglang.tp_size={r.sglang.tp_size} GPUs; make them equal")
    t_roll, t_train = r.sampling.temperature, cfg.train.temperature
    if t_roll != t_train:
        out.append(f"rollout.sampling.temperature={t_roll} and train.temperature={t_train} differ: the trainer must "
                   "score tokens under the distribution they were sampled from; set both to the same value")


def _colocated_sglang(cfg: RunConfig, out: List[str]) -> None:
    """Engine ``e``'s TP rank ``i`` runs on the GPU of trainer rank ``e * tp_size + i`` and takes its weights
    from that rank by CUDA IPC; the engines release their memory while the trainer runs."""
    r, p, s = cfg.rollout, cfg.parallel, cfg.rollout.sglang
    if r.transport != "ipc":
        out.append(f"rollout.engine='sglang' with placement='colocated' takes its weights by CUDA IPC from the trainer "
                   f"rank on each GPU (weight_transport 'ipc' or 'auto'), not {r.weight_transport!r}: a NCCL weight "
                   "group cannot hold a trainer rank and an engine rank of the same GPU")
    if not s.enable_memory_saver:
        out.append("rollout.engine='sglang' with placement='colocated' needs rollout.sglang.enable_memory_saver=true "
                   "(--enable-memory-saver): without it SGLang cannot release its weights, KV cache and CUDA graphs "
                   "while the trainer runs")
    if r.num_engines * s.tp_size > p.world_size:
        out.append(f"rollout.num_engines={r.num_engines} colocated SGLang servers of rollout.sglang.tp_size="
                   f"{s.tp_size} GPUs need {r.num_engines * s.tp_size} trainer GPUs, but parallel.world_size={p.world_size}; "
                   "lower num_engines or tp_size, or use placement=disaggregated")
    if cfg.cluster.gpus_per_trainer != 1:
        out.append(f"rollout.engine='sglang' with placement='colocated' shares each trainer rank's GPU with one "
                   f"engine TP rank: set cluster.gpus_per_trainer=1 (got {cfg.cluster.gpus_per_trainer})")


def _objective(cfg: RunConfig, out: List[str]) -> None:
    r, obj = cfg.rollout, cfg.train.objective
    if r.sampling.filtered and (r.logprob_mode == "processed") != obj.dvp.enabled:
        out.append(f"rollout.sampling filters tokens (top_k={r.sampling.top_k}, top_p={r.sampling.top_p}, min_p="
                   f"{r.sampling.min_p}) with rollout.logprob_mode={r.logprob_mode!r} but train.objective.dvp.enabled="
                   f"{obj.dvp.enabled}: full-vocabulary trainer log-probs compare with 'raw', DVP-pruned ones with "
                   "'processed'; make them agree")
    needs_old = obj.policy.mode == "decoupled"
    if r.mode == "one_step" and not needs_old and not obj.correction.active:
        out.append("rollout.mode='one_step' trains on one-step-stale samples: use train.objective.policy.mode=decoupled "
                   "or a train.objective.correction (e.g. is_level: token) so the staleness is corrected")
    if cfg.train.routing_replay and r.engine == "remote":
        out.append("train.routing_replay=true needs the rollout's expert choices: start the remote SGLang servers "
                   "with --enable-return-routed-experts (only engine 'embedded' or 'sglang' are checked here)")
    if obj.routing_mask.enabled and not cfg.train.routing_replay:
        out.append("train.objective.routing_mask.enabled=true compares the trainer's routing with the engine's, but "
                   "the run asks the engines for their expert choices only with train.routing_replay=true; set "
                   "train.routing_replay=true or disable the mask")
    routing = routing_fields(cfg)
    if routing and not cfg.model.routing_replay:
        out.append(f"{' and '.join(f + '=true' for f in routing)} but model.routing_replay=false builds the routers "
                   "without Megatron's RouterReplay, which replay and the mask read; set model.routing_replay=true")


ASYNC_WARNING = "UNCORRECTED ASYNCHRONOUS RL"


def _warn_uncorrected_async(cfg: RunConfig) -> None:
    """Async training without decoupled PPO or a rollout correction runs (the issue asks for a loud warning, not
    an error): its tokens are up to ``max_staleness`` versions stale and nothing reweights them."""
    r, obj = cfg.rollout, cfg.train.objective
    if r.mode != "async" or obj.policy.mode == "decoupled" or obj.correction.active:
        return
    message = (f"{ASYNC_WARNING}: rollout.mode='async' trains on tokens up to rollout.max_staleness={r.max_staleness} "
               f"weight versions old, but train.objective.policy.mode={obj.policy.mode!r} without a "
               "train.objective.correction treats them as on-policy (biased gradients; runs drift or collapse). Set "
               "train.objective.policy.mode=decoupled and/or a correction (e.g. correction.is_level=token)")
    logger.warning("\n%s\n%s\n%s", "!" * 100, message, "!" * 100)
    warnings.warn(message, UserWarning, stacklevel=3)


def routing_fields(cfg: RunConfig) -> List[str]:
    """The enabled fields that need an MoE model with router access."""
    return [f for f, on in (("train.routing_replay", cfg.train.routing_replay),
                            ("train.objective.routing_mask.enabled", cfg.train.objective.routing_mask.enabled)) if on]


def _warmup(cfg: RunConfig, out: List[str]) -> None:
    w = cfg.warmup
    if w.steps < 0:
        out.append(f"warmup.steps={w.steps} must be >= 0")
    if w.steps > 0 and cfg.train.reference_model is None:
        out.append(f"warmup.steps={w.steps} imitates a teacher: set warmup.teacher (an HF checkpoint directory)")
    if w.steps > 0 and not w.dense_kl.beta > 0:
        out.append(f"warmup.steps={w.steps} with warmup.dense_kl.beta={w.dense_kl.beta}: the warm-up would train on "
                   "nothing; set beta > 0 (e.g. 1.0) or warmup.steps=0")


def _eval(cfg: RunConfig, out: List[str]) -> None:
    e = cfg.eval
    if e.interval < 0 or e.max_prompts < 1:
        out.append(f"eval.interval={e.interval} must be >= 0 and eval.max_prompts={e.max_prompts} >= 1")
    if e.interval > 0 and not e.named_datasets:
        out.append(f"eval.interval={e.interval} but eval.data is not set; give eval.data.path (or eval.datasets) or "
                   "set eval.interval=0")
    if cfg.checkpoint.interval < 0:
        out.append(f"checkpoint.interval={cfg.checkpoint.interval} must be >= 0 (0: only at the end)")
    if cfg.stop_after_steps is not None and cfg.stop_after_steps < 1:
        out.append(f"stop_after_steps={cfg.stop_after_steps} must be >= 1 (or null)")
    if cfg.logging.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            out.append("logging.wandb=true but wandb is not installed: `pip install wandb` (and `wandb login`), or "
                       "set logging.wandb=false")


def _hf_dir(path: Optional[str], field: str, out: List[str]) -> None:
    if path is None:
        return
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        out.append(f"{field}={path!r} is not a local HF checkpoint directory (config.json + *.safetensors; cwd "
                   f"{os.getcwd()}); download one there: `huggingface-cli download ORG/{os.path.basename(os.path.normpath(path))} "
                   f"--local-dir {path}` (ORG: the model's publisher, e.g. Qwen)")


def _paths(cfg: RunConfig, out: List[str]) -> None:
    _hf_dir(cfg.model.hf_path, "model.hf_path", out)
    if cfg.train.reference_model is not None:
        where = "warmup.teacher" if cfg.warmup.teacher else "train.reference_model.hf_path"
        _hf_dir(cfg.train.reference_model.hf_path, where, out)
    if cfg.tokenizer is not None and not os.path.isdir(cfg.tokenizer):
        out.append(f"tokenizer={cfg.tokenizer!r} is not a directory (cwd {os.getcwd()}); point it at a saved HF "
                   "tokenizer or remove it to use model.hf_path's")
    fn = cfg.reward.custom_fn
    if fn:
        target = fn.rsplit(":", 1)[0]
        if target.endswith(".py") and not os.path.isfile(target):
            out.append(f"reward.custom_fn={fn!r}: file {target!r} does not exist (cwd {os.getcwd()})")
