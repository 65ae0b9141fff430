"""Objectives over vocabulary-sharded logits on 2 gloo TP ranks vs unsharded float64 references: the
DVP safe-set rules (math_spec §b.5.5) and TRM's exact rollout KL (§a.7.6).

The real vocabulary (29 columns) is not divisible by 2: the last shard carries a padding column filled
with a huge junk value that must never count; targets land in both shards.
"""

import torch
import torch.distributed as dist

from megatron_rl.objectives import DVPConfig, exact_rollout_kl, pruned_token_stats
from multiproc import run_distributed
from dvp_reference import ref_pruned
from ops_reference import pad_vocab, ref_kl

VOCAB, ROWS, WORLD = 29, 20, 2
CASES = [  # (cfg, temperature, chunk)
    (DVPConfig(enabled=True, rule="min_p", min_p=0.05), 1.0, None),
    (DVPConfig(enabled=True, rule="top_k", top_k=5), 0.8, 3),
    (DVPConfig(enabled=True, rule="top_p", top_p=0.85), 1.2, 7),
    (DVPConfig(enabled=True, rule="abs_logprob", abs_logprob=-4.0), 1.0, 4),
]


def _data():
    g = torch.Generator().manual_seed(5)
    z = torch.randn(ROWS, VOCAB, generator=g, dtype=torch.float64) * 3
    z[0] = -1e4
    z[0, 20] = 1e4  # one dominating logit in the second shard
    t = torch.arange(ROWS) * 7 % VOCAB
    t[1:4] = z[1:4].argmin(-1)
    return z, t


def _worker():
    rank = dist.get_rank()
    z, t = _data()
    full = pad_vocab(z, WORLD, fill=1e6)
    v_local = full.shape[-1] // WORLD
    out = []
    for cfg, temp, chunk in CASES:
        shard = full[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
        st = pruned_token_stats(shard, t, cfg, tp_group=dist.group.WORLD, vocab_size=VOCAB, temperature=temp,
                                chunk_size=chunk)
        w = torch.randn(ROWS, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        (st.logprobs * w).sum().backward()
        out.append((st.logprobs.detach(), st.kept_mass, st.target_kept, shard.grad))
    roll = pad_vocab(z.flip(0), WORLD, fill=-5.0)[:, rank * v_local:(rank + 1) * v_local]
    kl = exact_rollout_kl(full[:, rank * v_local:(rank + 1) * v_local], roll, tp_group=dist.group.WORLD,
                          vocab_size=VOCAB, temperature=0.9)
    return out, kl


def test_sharded_rules_match_unsharded_reference():
    outs = run_distributed(_worker, WORLD, timeout_s=120)
    results = [o[0] for o in outs]
    z, t = _data()
    kl_ref, _ = ref_kl(z, z.flip(0), VOCAB, direction="forward", temperature=0.9)  # KL(μ‖π), rollout first
    for _, kl in outs:
        torch.testing.assert_close(kl.double(), kl_ref, atol=1e-9, rtol=1e-9)
    w = torch.randn(ROWS, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for i, (cfg, temp, _) in enumerate(CASES):
        param = {"min_p": cfg.min_p, "top_k": cfg.top_k, "top_p": cfg.top_p, "abs_logprob": cfg.abs_logprob}[cfg.rule]
        x = z.clone().requires_grad_()
        ref = ref_pruned(x, t, VOCAB, cfg.rule, param, temp)
        (ref["logprobs"] * w).sum().backward()
        for lp, mass, kept, _ in (r[i] for r in results):
            torch.testing.assert_close(lp, ref["logprobs"].detach(), atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(mass, ref["kept_mass"], atol=1e-12, rtol=1e-12)
            assert torch.equal(kept, ref["target_kept"]), cfg.rule
        assert (~ref["target_kept"]).any() and ref["target_kept"].any()
        grad = torch.cat([r[i][3] for r in results], -1)
        torch.testing.assert_close(grad[:, :VOCAB], x.grad, atol=1e-12, rtol=1e-10)
        assert torch.all(grad[:, VOCAB:] == 0)
