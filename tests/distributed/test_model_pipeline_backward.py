"""Forward + backward through Megatron's pipeline schedule (1F1B, PP=2, two micro-batches) on CPU
gives HF's loss and HF's gradients for every parameter; the CPU compatibility layer is idempotent."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from multiproc import run_distributed, tiny_hf_checkpoint

from model_helpers import export_grads, hf_model, make_inputs

GRAD_ATOL = 1e-5
NUM_MICROBATCHES = 2


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _hf_reference(path, ids, labels):
    model = hf_model(path)
    losses = [_loss(model(i).logits, l) for i, l in zip(ids.chunk(NUM_MICROBATCHES), labels.chunk(NUM_MICROBATCHES))]
    loss = torch.stack(losses).mean()  # Megatron divides each micro-batch loss by their number
    loss.backward()
    return loss.item(), _checkpoint_names({n: p.grad.detach().clone() for n, p in model.named_parameters()})


def _checkpoint_names(grads):
    """transformers 5 fuses MoE experts in memory (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj``):
    split them into the per-expert checkpoint names the export uses."""
    out = {}
    for name, g in grads.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            for e in range(g.shape[0]):
                if leaf == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = g[e]
                else:
                    gate, up = g[e].chunk(2)
                    out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        else:
            out[name] = g
    return out


def _pp_backward_child(path, ids, labels):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl import compat, parallel
    from megatron_rl.models.build import build_model
    from megatron_rl.models.config import ModelConfig

    groups = parallel.init_megatron_parallel(parallel.ParallelLayout(pp=2))
    compat.apply()  # second call: must be a no-op
    built = build_model(ModelConfig(hf_path=path), groups)
    vocab = built.vocab_size
    mbs = ids.shape[0] // NUM_MICROBATCHES
    pos = torch.arange(ids.shape[1]).expand(mbs, -1)
    batches = iter(zip(ids.split(mbs), labels.split(mbs)))

    def step(data_iterator, model):
        tokens, target = next(data_iterator)
        out = model(tokens, pos, attention_mask=None)

        def loss_func(logits):
            loss = _loss(logits[..., :vocab], target)
            return loss, {"loss": loss.detach().clone()}  # the schedule scales `loss` in place

        return out, loss_func

    built.module.train()
    store = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=batches,
        model=[built.module],
        num_microbatches=NUM_MICROBATCHES,
        seq_length=ids.shape[1],
        micro_batch_size=mbs,
        forward_only=False,
    )
    loss = torch.stack([d["loss"] for d in store]).mean().item() if built.post_process else None
    return {"loss": loss, "grads": export_grads(built), "patches": compat.applied_patches()}


@pytest.mark.timeout(300)
# deepseek_v3: MLA, dense layer 0, 3 MoE layers; glm4_moe: q/k/v bias, q/k norm, partial RoPE, dense layer 0, 3 MoE layers
@pytest.mark.parametrize("model_type", ["qwen3", "deepseek_v3", "glm4_moe"])
def test_pipeline_forward_backward_matches_hf(tmp_path, model_type):
    path = tiny_hf_checkpoint(str(tmp_path / model_type), model_type, num_hidden_layers=4)
    ids = make_inputs(250, seed=1, batch=4)
    labels = make_inputs(250, seed=2, batch=4)
    ref_loss, ref_grads = _hf_reference(path, ids, labels)

    results = run_distributed(_pp_backward_child, 2, path, ids, labels, timeout_s=280)

    assert results[0]["loss"] is None  # the first stage computes no loss
    assert abs(results[1]["loss"] - ref_loss) < 1e-5, (results[1]["loss"], ref_loss)
    worst = {}
    for r in results:  # every rank holds every gradient after the export's PP broadcast
        # the export also yields DeepSeek's router score bias: a buffer (no gradient, frozen), not a parameter
        extra = set(r["grads"]) - set(ref_grads)
        assert set(ref_grads) <= set(r["grads"]) and all(n.endswith(".e_score_correction_bias") for n in extra)
        for name, ref in ref_grads.items():
            worst[name] = max(worst.get(name, 0.0), (r["grads"][name] - ref).abs().max().item())
    bad = {n: d for n, d in worst.items() if d > GRAD_ATOL}
    assert not bad, f"gradients differ from HF beyond {GRAD_ATOL}: {bad}"
    print(f"max |grad - HF| = {max(worst.values()):.2e}")
    patches = results[0]["patches"]
    assert len(patches) == len(set(patches)) > 5, patches
    assert all("remove when" in p for p in patches)
