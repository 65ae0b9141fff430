"""The portable core attention on packed (THD) input: the one-call padded SDPA and the block-diagonal mask
both equal plain causal SDPA run on each sequence alone (outputs and input gradients, float64), also on a
context-parallel rank's zigzag share (the plan's indices, without processes)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.models import attention


def _core():
    cfg = SimpleNamespace(softmax_type="vanilla", window_size=None, kv_channels=8, attention_dropout=0.0,
                          sequence_parallel=False)
    core = attention.SDPACoreAttention.__new__(attention.SDPACoreAttention)
    torch.nn.Module.__init__(core)
    core.config = cfg
    core.causal, core.scale, core.dropout = True, 8 ** -0.5, 0.0
    core.cp_group, core.cp = None, 1
    return core


@pytest.mark.parametrize("impl", ["auto", "padded", "per_length", "block_diagonal"])
def test_packed_attention_equals_each_sequence_alone(impl, monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams

    monkeypatch.setattr(attention, "PACKED_IMPL", impl)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 5, 1, 7, 3]
    t, heads, groups = sum(lengths), 4, 2
    q = torch.randn(t, heads, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, groups, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, groups, 8, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist(), dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    out = _core()(q, k, v, None, packed_seq_params=params)
    assert out.shape == (t, heads * 8)
    ref = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].permute(1, 0, 2)[None] for x in (q, k, v))
        ref.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=8 ** -0.5,
                                                  enable_gqa=True)[0].permute(1, 0, 2).reshape(b - a, -1))
    ref = torch.cat(ref)
    assert (out - ref).abs().max() < 1e-12
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    expect = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(grads, expect))


def _per_sequence(q, k, v, bounds, scale):
    """Plain causal SDPA on each sequence alone, concatenated: the reference."""
    ref = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[a:b].permute(1, 0, 2)[None] for x in (q, k, v))
        ref.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                  enable_gqa=True)[0].permute(1, 0, 2))
    return torch.cat(ref)


@pytest.mark.parametrize("impl", ["padded", "per_length", "block_diagonal"])
@pytest.mark.parametrize("cp, rank", [(2, 0), (2, 1), (3, 2)])
def test_packed_attention_on_a_cp_rank_equals_each_sequence_alone(impl, cp, rank):
    """A CP rank's zigzag rows attend to the right keys of the all-gathered (rank-order) stream: values and
    gradients equal the full per-sequence reference at that rank's positions."""
    from megatron_rl.models import packed_attention as pa

    g = torch.Generator().manual_seed(cp + rank)
    lengths = torch.tensor([4, 12, 8, 4, 20]) * cp // 2  # multiples of 2*cp
    bounds = [0] + torch.cumsum(lengths, 0).tolist()
    t, heads, groups, hn = bounds[-1], 4, 2, 8
    q = torch.randn(t, heads, hn, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, groups, hn, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, groups, hn, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor(bounds, dtype=torch.int32)
    starts = cu[:-1].long()
    cols = [pa.zigzag_stream_columns(starts, lengths, cp, r) for r in range(cp)]
    # the zigzag columns match Megatron's split of each sequence
    from megatron_rl.objectives.reduce import zigzag_split
    expect_cols = torch.cat([a + zigzag_split(torch.arange(int(n)), cp, rank) for a, n in zip(starts, lengths)])
    assert torch.equal(cols[rank], expect_cols)
    plan = pa.PackedPlan(cu, cp, rank, None, "cpu")
    gathered = torch.cat(cols)  # rank order, as the all-gather delivers the ranks' local streams

    def sdpa(q_, k_, v_, mask, causal, p):
        return F.scaled_dot_product_attention(q_, k_, v_, mask, p, is_causal=causal, scale=hn ** -0.5, enable_gqa=True)

    out = pa.packed_attention(impl, q[cols[rank]], k[gathered], v[gathered], plan, hn ** -0.5, 0.0, sdpa)
    ref = _per_sequence(q, k, v, bounds, hn ** -0.5)[cols[rank]]
    assert (out - ref).abs().max() < 1e-12
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    expect = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(grads, expect))


def test_packed_impl_is_chosen_by_device():
    from megatron_rl.models import packed_attention as pa

    x = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert pa.choose_impl("auto", x, 1, 0.0) == "per_length"  # CPU: per distinct length, neighbour-independent
    assert pa.choose_impl("block_diagonal", x, 1, 0.0) == "block_diagonal"
    with pytest.raises(ValueError, match="PACKED_IMPL"):
        pa.choose_impl("per_sequence", x, 1, 0.0)


@pytest.mark.parametrize("cp, rank", [(1, 0), (2, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("stream_freqs", [False, True])
def test_vectorised_packed_rope_equals_megatrons_loop(cp, rank, stream_freqs):
    """megatron_rl.compat replaces Megatron's per-sequence THD RoPE loop: the same values, bitwise."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl import compat

    compat.apply()
    patched = rope_utils._apply_rotary_pos_emb_thd
    assert getattr(patched, "_megatron_rl_compat", False)
    g = torch.Generator().manual_seed(cp)
    full = [8 * cp, 2 * cp, 6 * cp]  # sequence lengths, multiples of 2*cp
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(full), 0).tolist(), dtype=torch.int32)
    t = torch.randn(sum(full) // cp, 3, 8, generator=g, dtype=torch.float64)
    freqs = torch.randn(int(cu[-1]) if stream_freqs else max(full), 1, 1, 8, generator=g, dtype=torch.float64)
    group = SimpleNamespace(size=lambda: cp, rank=lambda: rank)
    got = patched(t, cu, freqs, cp_group=group)
    expect = _megatron_thd_rope(t, cu, freqs, group)
    assert torch.equal(got, expect)


def _megatron_thd_rope(t, cu, freqs, group):
    """Megatron-Core 0.16.1's loop (rope_utils._apply_rotary_pos_emb_thd), restated for the comparison."""
    from megatron.core.models.common.embeddings import rope_utils

    size, rank = group.size(), group.rank()
    seqlens = ((cu[1:] - cu[:-1]) // size).tolist()
    splits = torch.split(t, seqlens)
    offsets = cu[:-1].tolist() if freqs.size(0) == cu[-1] else [0] * len(seqlens)
    packed = torch.cat([rope_utils._get_thd_freqs_on_this_cp_rank(rank, size, x, freqs, o)
                        for x, o in zip(splits, offsets)])
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), packed).squeeze(1)
