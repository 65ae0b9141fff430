"""Rollout routing replay end to end on a tiny Qwen3-MoE: the embedded engine samples with routing capture
while routing differently from the trainer (engine in bf16, or its router weights perturbed); the
Megatron trainer (fp32) scores the engine's samples with and without replay.

Checks: replay brings the trainer's log-probs of the engine's samples closer to the engine's (measured:
mean |Δ log p| and the k3 mismatch KL), routing agreement < 1 without replay; the metrics of a train
step (agreement, mismatch with and without replay, the routing mask); replay in the reference model's
pass; misaligned routes raise; replay under EP=2, PP=2, TP=2 with sequence parallelism, and activation
recompute with PP=2 equals EP=1/PP=1.

The numbers are printed (``pytest -s``) as the table quoted in the issue's closing note.
"""

from __future__ import annotations


import pytest
import torch

from multiproc import run_distributed, tiny_hf_checkpoint

PERTURB = 0.01  # std of the noise added to the engine's router weights (HF init std of the tiny model: 0.1)


def _engine_batch(path: str, variant: str, fill_last_routing: bool = True, n: int = 16):
    """Samples of the engine ``variant`` ('bf16' | 'perturbed'), as a TrainBatch with routes attached."""
    from megatron_rl.models.build import load_arch
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.client.protocol import GenerateRequest, SamplingParams
    from megatron_rl.routing import RoutingLayout, attach_routes
    from megatron_rl.training import TrainBatch

    cfg = EmbeddedEngineConfig(fill_last_routing=fill_last_routing)
    engine = EmbeddedEngine.from_pretrained(path, cfg, dtype=torch.bfloat16 if variant == "bf16" else torch.float32)
    if variant == "perturbed":
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in engine.model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.add_(PERTURB * torch.randn(p.shape, generator=g))
    requests = [GenerateRequest(tuple(range(5 + i, 9 + i + i % 4)), return_routed_experts=True,
                                sampling=SamplingParams(max_new_tokens=6 + (3 * i) % 8, seed=i, ignore_eos=True))
                for i in range(n)]
    samples = engine.generate(requests)
    g = torch.Generator().manual_seed(2)
    batch = TrainBatch.from_sequences([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                      rollout_logprobs=[s.logprobs for s in samples],
                                      advantages=torch.randn(n, generator=g).tolist())
    return attach_routes(batch, samples, RoutingLayout.from_arch(load_arch(path)))


def _trainer(path, groups, optim=False, **train):
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.training import OptimConfig, PolicyTrainer, TrainConfig

    model_overrides = train.pop("model_overrides", {})
    return PolicyTrainer(ModelConfig(hf_path=path, **model_overrides), TrainConfig(**train), groups,
                         OptimConfig(lr=1e-3) if optim else None)


def _bypass(**kw):
    from megatron_rl.objectives import ObjectiveConfig, PolicyLossConfig

    return ObjectiveConfig(policy=PolicyLossConfig(mode="bypass"), **kw)


def _single_rank_child(path, batches):
    from megatron_rl import parallel
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.objectives import DenseKLConfig, ObjectiveConfig, RoutingMaskConfig, TRMConfig
    from megatron_rl.routing import RoutingDiagnosticsConfig

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout())
    plain = _trainer(path, groups, micro_batch_size=4)
    replay = _trainer(path, groups, micro_batch_size=4, routing_replay=True)
    out = {}
    for name, batch in batches.items():
        for label, trainer in (("no_replay", plain), ("replay", replay)):
            f = trainer.forward(batch)
            out[f"{name}/{label}"] = {**f.metrics, "logprobs": f.logprobs, "disagreement": f.routing_disagreement}

    # A train step with every routing metric, the routing mask ANDed with TRM; the mask's input comes
    # from the trainer's own pass (prepare) or from forward().
    batch = batches["perturbed"]
    mask = RoutingMaskConfig(enabled=True, max_disagreement=0.25, level="sequence")
    step = _trainer(path, groups, optim=True, micro_batch_size=4, routing_replay=True,
                    routing_diagnostics=RoutingDiagnosticsConfig(without_replay=True),
                    objective=_bypass(routing_mask=mask, trm=TRMConfig(enabled=True, max_kl=2.0, divergence="sample")))
    out["step"] = step.train_step(batch).metrics

    # Reference model = the policy's weights: with replay in both passes the exact KL is 0.
    ref = _trainer(path, groups, micro_batch_size=4, routing_replay=True, reference_model=ModelConfig(hf_path=path),
                   objective=ObjectiveConfig(dense_kl=DenseKLConfig(beta=0.1)))
    out["ref_kl_max"] = ref.forward(batch).ref_kl.abs().max().item()

    errors = {}
    wrong_layers = batch.replace(routed_experts=batch.routed_experts[:, :, :1])
    perm = torch.tensor([1, 0] + list(range(2, batch.batch_size)))
    shuffled = batch.replace(routed_experts=batch.routed_experts[perm], route_checksums=batch.route_checksums[perm])
    for what, bad in (("layers", wrong_layers), ("order", shuffled)):
        try:
            replay.forward(bad)
        except ValueError as e:
            errors[what] = str(e)
    from megatron_rl.models.router import replay_routing

    ids = torch.arange(12).remainder(250).reshape(1, 12)
    routes = {layer: torch.tensor([[0, 1]] * 11) for layer in (0, 1)}  # 11 rows for 12 tokens
    try:
        with replay_routing(replay.built, routes):
            replay.module(ids, torch.arange(12)[None], attention_mask=None)
    except ValueError as e:
        errors["tokens"] = str(e)
    return out, errors


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    # 16 experts, top-2: more near-ties between experts than 4, as in real MoE models (bf16 flips some)
    return tiny_hf_checkpoint(str(tmp_path_factory.mktemp("moe") / "qwen3_moe"), "qwen3_moe", num_experts=16)


@pytest.mark.timeout(300)
def test_replay_brings_trainer_closer_to_engine_and_logs_routing_metrics(moe_path):
    batches = {"bf16": _engine_batch(moe_path, "bf16"),
               "perturbed": _engine_batch(moe_path, "perturbed", fill_last_routing=False)}  # SGLang-like last row
    (out, errors), = run_distributed(_single_rank_child, 1, moe_path, batches, timeout_s=280)

    print("\nengine      replay  agreement_mean  layer0  layer1  mean|dlogp|  k3")
    for name in batches:
        for label in ("no_replay", "replay"):
            m = out[f"{name}/{label}"]
            print(f"{name:10}  {label:9} {m['routing/agreement_mean']:.4f}  {m['routing/agreement_layer0']:.4f}  "
                  f"{m['routing/agreement_layer1']:.4f}  {m['routing/logprob_abs_diff']:.5f}  "
                  f"{m['routing/mismatch_k3']:.6f}")
        off, on = out[f"{name}/no_replay"], out[f"{name}/replay"]
        assert off["routing/agreement_mean"] < 1.0, name
        assert on["routing/logprob_abs_diff"] < off["routing/logprob_abs_diff"], name
        assert on["routing/mismatch_k3"] < off["routing/mismatch_k3"], name
        lp_on = on["logprobs"]
        mask, mu = batches[name].response_mask, batches[name].rollout_logprobs
        assert (lp_on - mu)[mask].abs().mean().item() == pytest.approx(on["routing/logprob_abs_diff"], rel=1e-6)
        assert on["disagreement"].shape == mask.shape and (on["disagreement"][~mask] == 0).all()
    # The perturbed routers disagree a lot: replay must remove most of the mismatch.
    p_off, p_on = out["perturbed/no_replay"], out["perturbed/replay"]
    assert p_on["routing/logprob_abs_diff"] < 0.8 * p_off["routing/logprob_abs_diff"]

    step = out["step"]
    print("train step:", {k: round(v, 5) for k, v in sorted(step.items()) if k.startswith(("routing", "trm/acc",
                                                                                         "correction/seq"))})
    assert step["routing/no_replay/logprob_abs_diff"] == pytest.approx(p_off["routing/logprob_abs_diff"], rel=1e-5)
    assert step["routing/no_replay/agreement_mean"] == pytest.approx(p_off["routing/agreement_mean"], rel=1e-6)
    assert step["routing/logprob_abs_diff"] == pytest.approx(p_on["routing/logprob_abs_diff"], rel=1e-5)
    assert step["routing/agreement_mean"] == pytest.approx(p_on["routing/agreement_mean"], rel=1e-6)
    assert step["routing_mask/seq_acceptance"] < 1.0
    assert step["correction/seq_acceptance"] <= step["routing_mask/seq_acceptance"]
    assert out["ref_kl_max"] <= 1e-5

    assert "has 1 MoE layers x top-2, but the trainer's model has 2 MoE layers x top-2" in errors["layers"]
    assert "the routes of row(s)" in errors["order"] and "out of order" in errors["order"]
    assert "11 tokens of expert ids but the model routes 12" in errors["tokens"]


def _layout_child(path, batch, cases):
    from megatron_rl import parallel
    from megatron_rl.routing import RoutingDiagnosticsConfig

    out = {}
    for name, layout, train in cases:
        groups = parallel.init_megatron_parallel(parallel.ParallelLayout(**layout))
        trainer = _trainer(path, groups, optim=True, routing_replay=True, objective=_bypass(),
                           routing_diagnostics=RoutingDiagnosticsConfig(without_replay=True), **train)
        dp = torch.distributed.get_world_size(groups.dp)
        local = batch.split(dp)[groups.dp_rank]
        f = trainer.forward(local)
        r = trainer.train_step(local)
        assert trainer.built.tconfig.recompute_granularity == train.get("model_overrides", {}).get(
            "transformer_overrides", {}).get("recompute_granularity")
        routing = {k: v for k, v in r.metrics.items() if k.startswith("routing")}
        out[name] = {"rows": groups.dp_rank, "dp": dp, "logprobs": f.logprobs, "loss": r.loss,
                     "grad_norm": r.grad_norm, "metrics": routing}
    return out


@pytest.mark.timeout(300)
def test_replay_is_invariant_under_ep_pp_and_recompute(moe_path):
    batch = _engine_batch(moe_path, "perturbed")
    recompute = dict(model_overrides=dict(transformer_overrides={
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}))
    cases = [("ep1pp1", {}, dict(micro_batch_size=4)),
             ("ep2", dict(ep=2), dict(micro_batch_size=2)),
             ("pp2", dict(pp=2), dict(micro_batch_size=2)),
             ("tp2_sp", dict(tp=2, ep=2, etp=1), dict(micro_batch_size=2)),  # sequence-parallel slices of the ids
             # 1F1B keeps several micro-batches in flight: recomputes must replay their own forward's ids
             ("pp2_recompute", dict(pp=2), dict(micro_batch_size=2, **recompute))]
    results = run_distributed(_layout_child, 2, moe_path, batch, cases, timeout_s=280)

    def full_logprobs(name):
        parts = {r[name]["rows"]: r[name]["logprobs"] for r in results}
        return torch.cat([parts[i] for i in sorted(parts)])

    base = results[0]["ep1pp1"]
    for name, _, _ in cases[1:]:
        run = results[0][name]
        assert torch.allclose(full_logprobs(name), full_logprobs("ep1pp1"), atol=1e-5, rtol=0), name
        assert run["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-6), name
        assert run["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-5), name
        assert set(run["metrics"]) == set(base["metrics"]), name
        for k, v in base["metrics"].items():
            assert run["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (name, k)
    assert base["metrics"]["routing/no_replay/agreement_mean"] < 1.0
    # every layout forced the engine's experts at every routed position of the batch, once per MoE layer
    from megatron_rl.routing import FREE

    routed = batch.routed_experts[..., 0] != FREE  # [B, S, layers]
    assert base["metrics"]["routing/replayed_tokens"] == routed.sum().item() / routed.shape[-1] > 0


def _probe_child(path):
    """The post-sync probe with and without replaying the engine's routing of the probe (EP=2: every rank runs
    the probe forward with the routes rank 0's engine reported)."""
    import torch.distributed as dist

    from megatron_rl import parallel
    from megatron_rl.models.build import build_model
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.rollout.embedded.engine import EmbeddedEngine
    from megatron_rl.weights.sync import WeightSync, WeightSyncConfig

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout(ep=2))
    built = build_model(ModelConfig(hf_path=path, routing_replay=True), groups)
    out = {}
    for variant in ("bf16", "perturbed"):
        engine = None
        if dist.get_rank() == 0:
            engine = EmbeddedEngine.from_pretrained(path, dtype=torch.bfloat16 if variant == "bf16" else torch.float32)
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for name, p in engine.model.named_parameters():
                    if variant == "perturbed" and name.endswith("mlp.gate.weight"):
                        p.add_(PERTURB * torch.randn(p.shape, generator=g))
        for replay in (False, True):
            cfg = WeightSyncConfig(check_tolerance=100.0, replay_routing=replay, progress=False, probe_length=128)
            check = WeightSync(built, engine, cfg).check()
            out[(variant, replay)] = (check.max_abs_diff, check.mean_abs_diff)
    return out


@pytest.mark.timeout(300)
def test_the_weight_sync_probe_replays_the_engines_routing(moe_path):
    """A bf16 or differently-routing engine flips some of the probe's experts; the probe check then compares
    log-probs under different routings. Replaying the engine's routing of the probe leaves the weights'
    difference alone (issue 11: the bf16 MoE recipe's probe failures)."""
    out = run_distributed(_probe_child, 2, moe_path, timeout_s=280)[0]
    for variant in ("bf16", "perturbed"):
        (off_max, off_mean), (on_max, on_mean) = out[(variant, False)], out[(variant, True)]
        print(f"\n{variant}: probe max |dlogp| {off_max:.4f} -> {on_max:.4f} with replay; mean {off_mean:.5f} -> "
              f"{on_mean:.5f}")
        assert on_mean < 0.7 * off_mean and on_max < 0.2 * off_max, variant
    # measured 0.53 -> 0.026: routing flips alone move a bf16 probe past 0.25 at the start of training
    assert out[("bf16", False)][0] > 0.25 > out[("bf16", True)][0]
