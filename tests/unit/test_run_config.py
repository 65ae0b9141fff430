"""The run config: recipes + overrides -> RunConfig, and the checks that run before anything starts.
Every error must name the fields, their values and a fix."""

import json

import pytest

from megatron_rl import cli, config_io
from megatron_rl.config import RunConfig, resolve_mapping, build_run_config
from megatron_rl.preflight import check_run_config, load_run_config
from megatron_rl.config_io import ConfigError
from megatron_rl.training import checkpoint_integrity as integrity

from run_helpers import MOE_RECIPE, REPO, TINY_RECIPE, quick_assets, tiny_overrides


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return quick_assets(tmp_path_factory.mktemp("assets"))


def _load(assets, tmp_path, *extra):
    return load_run_config(TINY_RECIPE, tiny_overrides(assets, tmp_path / "out", *extra))


def test_tiny_recipe_resolves(assets, tmp_path):
    cfg = _load(assets, tmp_path, "rollout.n_samples_per_prompt=4", "optim.lr=1e-3")
    assert isinstance(cfg, RunConfig)
    assert cfg.rollout.n_samples_per_prompt == 4 and cfg.optim.lr == 1e-3 and cfg.optim.schedule.lr == 1e-3
    assert cfg.parallel.tp == 2 and cfg.parallel.dp == 1 and cfg.rollout.transport == "tensor"
    # the warm-up teacher is the trainer's reference model; the objective switches after the warm-up
    assert cfg.train.reference_model.hf_path == assets["teacher"]
    assert cfg.objective_at(2).dense_kl.beta == 1.0 and cfg.objective_at(3).dense_kl.beta == 0.0


@pytest.mark.parametrize("overrides,needles", [
    (["rollout.prompts_per_step=3", "train.micro_batch_size=16", "train.max_tokens_per_micro_batch=0",
      "train.forward_max_tokens_per_micro_batch=0"],
     ["rollout.prompts_per_step * rollout.n_samples_per_prompt = 3 * 8 = 24", "train.micro_batch_size = 1 * 16 = 16",
      "make prompts_per_step a multiple of 2"]),
    (["parallel.world_size=3"], ["parallel.world_size=3 is not divisible by parallel.tp * parallel.pp * parallel.cp "
                                 "= 2 * 1 * 1 = 2"]),
    (["parallel.cp=2"], ["parallel.tp * parallel.pp * parallel.cp = 2 * 1 * 2 = 4", "change tp/pp/cp"]),
    (["train.max_tokens_per_micro_batch=8"], ["data.max_prompt_tokens + rollout.sampling.max_new_tokens = 20 tokens",
                                              "train.max_tokens_per_micro_batch=8 x parallel.cp=1 = 8",
                                              "raise train.max_tokens_per_micro_batch to >= 20"]),
    (["parallel.cp=2", "parallel.tp=1", "train.max_tokens_per_micro_batch=8"],
     ["(20 once padded for parallel.cp=2", "train.max_tokens_per_micro_batch=8 x parallel.cp=2 = 16",
      "raise train.max_tokens_per_micro_batch to >= 10 or parallel.cp"]),
    (["train.packing=false", "train.max_tokens_per_micro_batch=64"],
     ["train.max_tokens_per_micro_batch=64 packs sequences under a token budget, which needs train.packing=true"]),
    (["parallel.world_size=8", "parallel.tp=8"], ["num_attention_heads=4 is not divisible by the parallel size 8",
                                                  "parallel (tp=8"]),
    (["rollout.sampling.temperature=0.7"], ["rollout.sampling.temperature=0.7 and train.temperature=1.0 differ"]),
    (["rollout.mode=one_step"], ["rollout.mode='one_step' generates while the trainer trains",
                                 "set rollout.placement=disaggregated"]),
    (["rollout.mode=async"], ["rollout.mode='async'", "colocated", "nothing can overlap"]),
    (["rollout.max_staleness=0"], ["rollout.max_staleness=0 must be >= 1"]),
    (["rollout.partial=true"], ["rollout.partial=true", "only rollout.mode='async' has (mode is 'sync')"]),
    (["rollout.off_policy=1", "rollout.mode=async"], ["rollout.off_policy=1 (deprecated, = rollout.mode='one_step') "
                                                      "contradicts rollout.mode='async'"]),
    (["rollout.engine=remote"], ["rollout.engine='remote' needs rollout.urls"]),
    (["rollout.sampling.max_new_tokens=60"], ["data.max_prompt_tokens + rollout.sampling.max_new_tokens = 16 + 60",
                                             "max_position_embeddings=64"]),
    (["rollout.sampling.top_p=0.9", "rollout.logprob_mode=processed"],
     ["rollout.logprob_mode='processed'", "train.objective.dvp.enabled=False"]),
    (["warmup.dense_kl.beta=0"], ["warmup.dense_kl.beta=0.0", "set beta > 0"]),
    (["eval.data=null"], ["eval.interval=2 but eval.data is not set"]),
    (["rollout.max_samples_in_flight=0"], ["rollout.max_samples_in_flight=0 must be >= 1"]),
    (["rollout.n_samples_per_prompt=1", "rollout.prompts_per_step=16"], ["estimator='grpo'", "n_samples_per_prompt=1"]),
    (["train.routing_replay=true"], ["train.routing_replay=true but model.hf_path=", "is a dense 'qwen3' model",
                                     "set train.routing_replay to false", "prepare.model=qwen3_moe"]),
    (["train.objective.routing_mask.enabled=true"], ["train.objective.routing_mask.enabled=true compares",
                                                     "set train.routing_replay=true"]),
    (["rollout.embedded_dtype=bfloat16", "rollout.weight_sync.check_tolerance=1e-4"],
     ["rollout.embedded_dtype='bfloat16'", "rollout.weight_sync.check_tolerance=0.0001", "set it to 0.25"]),
    (["rollout.deterministic_inference=false"], ["rollout.seeded=true needs", "--enable-deterministic-inference",
                                                 "rollout.deterministic_inference=false"]),
    (["rollout.sampling.min_p=0.05", "rollout.logprob_mode=processed", "train.objective.dvp.enabled=true"],
     ["rollout.sampling.min_p=0.05 with deterministic inference", "asserts on min_p > 0"]),
    (["rollout.sampling.top_p=0.9", "rollout.logprob_mode=processed", "train.objective.dvp.enabled=true"],
     ["rollout.logprob_mode='processed' reads SGLang's output_token_sampling_logprobs", "rollout.sampling.top_k=-1",
      "--sampling-mask-max-tokens (4096)"]),
    (["rollout.engine=remote", "rollout.urls=[http://127.0.0.1:30000]", "rollout.weight_transport=tensor"],
     ["rollout.weight_transport='tensor'", "SGLang refuses (engine='remote')"]),
    (["train.routing_replay=true", "model.routing_replay=false"], ["train.routing_replay=true but "
                                                                   "model.routing_replay=false"]),
    (["profile.steps=[2,9]", "profile.trainer_ranks=[0,2]"], ["profile.steps=[2, 9]: step(s) [9] come after the last "
                                                             "step (steps=3)", "profile.trainer_ranks=[0, 2]: rank(s) "
                                                             "[2] do not exist with parallel.world_size=2"]),
])
def test_cross_field_errors_name_fields_values_and_fix(assets, tmp_path, overrides, needles):
    with pytest.raises(ConfigError) as e:
        _load(assets, tmp_path, *overrides)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_remote_servers_distributed_transport_and_seed_check(assets, tmp_path):
    """engine=remote: weight_transport=auto is 'distributed' (SGLang takes no safetensors buckets), and a seeded
    run refuses a server whose /server_info says it ignores sampling_seed (no --enable-deterministic-inference)."""
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded.server import EmbeddedServer

    from rollout_models import tiny_qwen3

    honours, ignores = (EmbeddedServer(EmbeddedEngine(tiny_qwen3(), EmbeddedEngineConfig(seeds=s))).start()
                        for s in ("deterministic", "ignored"))
    try:
        for placement in ("colocated", "disaggregated"):
            cfg = _load(assets, tmp_path, "rollout.engine=remote", f"rollout.urls=[{honours.url}]",
                        f"rollout.placement={placement}")
            assert cfg.rollout.weight_transport == "auto" and cfg.rollout.transport == "distributed"
        urls = f"rollout.urls=[{honours.url},{ignores.url}]"
        with pytest.raises(ConfigError) as info:
            _load(assets, tmp_path, "rollout.engine=remote", urls)
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith(f"rollout.urls[1]='{ignores.url}' must honour sampling_seed")
        assert "its /server_info has enable_deterministic_inference=False; start the server with --enable-" \
               "deterministic-inference, or set rollout.seeded=false" in msg
        assert _load(assets, tmp_path, "rollout.engine=remote", urls, "rollout.seeded=false").rollout.urls[1] \
            == ignores.url  # unseeded: nothing to check
    finally:
        honours.stop()
        ignores.stop()


def test_rollout_modes_and_the_deprecated_off_policy_alias(assets, tmp_path, caplog):
    disaggregated = "rollout.placement=disaggregated"
    with caplog.at_level("WARNING"):
        cfg = _load(assets, tmp_path, "rollout.off_policy=1", disaggregated)
    assert cfg.rollout.mode == "one_step" and cfg.rollout.off_policy is None
    assert "rollout.off_policy=1 is deprecated: use rollout.mode=one_step" in caplog.text
    assert _load(assets, tmp_path, "rollout.off_policy=0").rollout.mode == "sync"
    cfg = _load(assets, tmp_path, "rollout.mode=async", "rollout.max_staleness=2", "rollout.partial=true", disaggregated)
    assert (cfg.rollout.mode, cfg.rollout.max_staleness, cfg.rollout.partial) == ("async", 2, True)
    # async without decoupled PPO or a rollout correction runs, with a loud warning
    from megatron_rl.config.checks import ASYNC_WARNING

    plain = ["train.objective.policy.mode=bypass", "train.objective.correction.is_level=null"]
    with pytest.warns(UserWarning, match=ASYNC_WARNING):
        _load(assets, tmp_path, "rollout.mode=async", disaggregated, *plain)
    with pytest.raises(ConfigError, match="one-step-stale samples"):  # one_step keeps its error
        _load(assets, tmp_path, "rollout.mode=one_step", disaggregated, *plain)


def test_tiny_moe_assets_keep_their_own_directory(assets, tmp_path):
    """prepare.model picks the tiny model; a directory of one kind is never reused for the other."""
    from megatron_rl.data.tiny_task import prepare_tiny_arithmetic
    from megatron_rl.models.build import load_arch

    moe = prepare_tiny_arithmetic(str(tmp_path / "moe"), model="qwen3_moe", sft_steps=2)
    arch = load_arch(moe["student"])
    assert (arch.model_type, arch.num_experts, arch.moe_topk, arch.moe_layers) == ("qwen3_moe", 8, 2, (True, True))
    assert json.loads((tmp_path / "moe" / "READY.json").read_text())["params"]["model_kind"] == "qwen3_moe"
    assert prepare_tiny_arithmetic(str(tmp_path / "moe"), model="qwen3_moe", sft_steps=2) == moe  # present: reused
    dense_dir = assets["student"].rsplit("/", 1)[0]
    with pytest.raises(ConfigError, match=r"holds tiny qwen3 assets but prepare.model='qwen3_moe'; use another "
                                          r"prepare.dir"):
        load_run_config(TINY_RECIPE, ["prepare.kind=tiny_arithmetic", f"prepare.dir={dense_dir}",
                                      "prepare.model=qwen3_moe"], check=False)
    # the MoE recipe resolves on these assets: replay + mask on an MoE model pass every check
    cfg = load_run_config(MOE_RECIPE, tiny_overrides(moe, tmp_path / "out"))
    assert cfg.train.routing_replay and cfg.train.objective.routing_mask.enabled and cfg.parallel.ep == 2


def test_all_problems_reported_at_once(assets, tmp_path):
    with pytest.raises(ConfigError) as e:
        _load(assets, tmp_path, "parallel.world_size=3", "rollout.sampling.temperature=0.5", "rollout.off_policy=1")
    assert str(e.value).startswith("3 problems in the config")


def test_tokenizer_larger_than_model_vocabulary(assets, tmp_path):
    from multiproc import tiny_hf_checkpoint

    small = tiny_hf_checkpoint(str(tmp_path / "small"), "qwen3", vocab_size=32, max_position_embeddings=64)
    with pytest.raises(ConfigError) as e:
        _load(assets, tmp_path, f"model.hf_path={small}", f"tokenizer={assets['tokenizer']}",
              f"warmup.teacher={small}")
    assert "has 64 tokens but model.hf_path's vocab_size is 32" in str(e.value)


@pytest.mark.parametrize("overrides,needle", [
    (["model.hf_path=/nowhere/model"], "model.hf_path='/nowhere/model' is not a local HF checkpoint directory"),
    (["warmup.teacher=/nowhere/teacher"], "warmup.teacher='/nowhere/teacher' is not a local HF checkpoint"),
    (["data.path=/nowhere/train.jsonl"], "data.path='/nowhere/train.jsonl' does not exist"),
    (["reward.kind=custom", "reward.custom_fn=/nowhere/r.py:fn"], "file '/nowhere/r.py' does not exist"),
    (["rollout.n_sample_per_prompt=4"], "rollout.n_sample_per_prompt: unknown field; did you mean 'n_samples_per_prompt'?"),
    (["rollout.placement=split"], "rollout.placement='split': expected one of ['colocated', 'disaggregated']"),
    (["steps=ten"], "steps='ten': expected an integer"),
])
def test_paths_and_unknown_keys(assets, tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as e:
        _load(assets, tmp_path, *overrides)
    assert needle in str(e.value)
    assert "RunConfig." not in str(e.value)  # paths read as the user writes them


def test_missing_files_are_listed_together(assets, tmp_path):
    """--dry-run of a recipe whose data and model are not there yet: every missing path in one error (not one
    per invocation), the data ones pointing at tools/prepare_math_data.py."""
    with pytest.raises(ConfigError) as e:
        _load(assets, tmp_path, "model.hf_path=/nowhere/model", "data.path=/nowhere/train.jsonl",
              "eval.data=null", "eval.datasets.a.path=/nowhere/a.jsonl", "eval.datasets.b.path=/nowhere/b.jsonl")
    msg = str(e.value)
    for needle in ("model.hf_path='/nowhere/model'", "data.path='/nowhere/train.jsonl' does not exist",
                   "eval.datasets.a.path='/nowhere/a.jsonl'", "eval.datasets.b.path='/nowhere/b.jsonl'"):
        assert needle in msg
    assert msg.count("tools/prepare_math_data.py") == 3


def test_existing_checkpoints_need_resume_or_overwrite(assets, tmp_path):
    ckpt = tmp_path / "out" / "checkpoints" / "iter_0000002"
    ckpt.mkdir(parents=True)
    with pytest.raises(ConfigError, match="pass resume=true to continue it, overwrite=true to start over"):
        _load(assets, tmp_path)
    # a folder without its manifest was never completed: nothing to resume from
    with pytest.raises(ConfigError, match=r"holds checkpoints \(steps \[2\]\) but none can be resumed"):
        _load(assets, tmp_path, "resume=true")
    (ckpt / integrity.MANIFEST).write_text("{}")
    assert _load(assets, tmp_path, "resume=true").resume


def test_gpu_recipes_are_consistent(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    for name, world, layout in (("qwen3_dense.yaml", 4, (2, 2, 1)), ("qwen3_moe.yaml", 8, (2, 1, 8)),
                                ("deepseek_v3.yaml", 8, (2, 1, 8))):
        mapping = resolve_mapping(str(REPO / "examples" / name), [f"data.path={data}", f"eval.data.path={data}"]
                                  if name == "qwen3_dense.yaml" else [f"data.path={data}"])
        cfg = build_run_config(mapping)
        check_run_config(cfg, files=False)  # no checkpoints here: everything but the model files
        p = cfg.parallel
        assert (p.world_size, (p.tp, p.pp, p.ep)) == (world, layout)
        assert cfg.rollout.engine == "sglang" and cfg.rollout.transport == "distributed"
        assert cfg.slurm is not None and cfg.slurm.gpus_per_node == 8
        assert cfg.train.packing and cfg.train.max_tokens_per_micro_batch >= 5120
        # the long-context variant the recipes describe: twice the ranks, every sequence split over 2
        long = build_run_config(config_io.merge(mapping, config_io.parse_overrides(
            [f"parallel.world_size={2 * world}", "parallel.cp=2"])))
        check_run_config(long, files=False)
        assert long.parallel.dp == cfg.parallel.dp


def test_cli_dry_run_and_config_error_exit_codes(assets, tmp_path, capsys):
    assert cli.main(["train", TINY_RECIPE, *tiny_overrides(assets, tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "n_samples_per_prompt: 8" in out and f"hf_path: {assets['student']}" in out
    assert cli.main(["train", TINY_RECIPE, *tiny_overrides(assets, tmp_path / "out", "parallel.world_size=3"),
                     "--dry-run"]) == 2
    assert "parallel.world_size=3" in capsys.readouterr().err


def test_wandb_missing_is_a_config_error(assets, tmp_path):
    try:
        import wandb  # noqa: F401
        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match=r"logging.wandb=true but wandb is not installed: `pip install wandb`"):
        _load(assets, tmp_path, "logging.wandb=true")
