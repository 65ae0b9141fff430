"""Micro-batch layouts: padded rows and packed streams, whole or split over context-parallel ranks.

Every layout must score exactly the same response tokens from the same contexts: for each response token,
exactly one CP rank holds the position whose logits predict it, its target there is that token, the
position's input is the token before it, and its position id (RoPE) counts from its own sequence's start.
Packed streams: ``cu_seqlens`` boundaries, CP segments multiples of ``2·cp``, the stream a multiple of
what sequence parallelism needs; routes follow their tokens.
"""

import math

import pytest
import torch

from megatron_rl.training import TrainBatch
from megatron_rl.training.micro_batch import build_micro_batches, packed_lengths


def _batch(B=5, seed=0, topk=2):
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(1, 5, (B,), generator=g)
    rlen = torch.randint(0, 8, (B,), generator=g)
    rlen[0] = 7
    prompts = [torch.randint(1, 90, (int(n),), generator=g) for n in plen]
    responses = [torch.randint(1, 90, (int(n),), generator=g) for n in rlen]
    routed = [torch.stack([torch.randperm(6, generator=g)[:topk] for _ in range(int(p + r))])[:, None]
              for p, r in zip(plen, rlen)]
    batch = TrainBatch.from_sequences(prompts, responses, routed_experts=routed,
                                      advantages=[float(i) for i in range(B)])
    return batch, prompts, responses


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cp, multiple", [(1, 1), (1, 4), (2, 1), (2, 4), (3, 2)])
def test_every_response_token_is_scored_once_from_its_own_context(packed, cp, multiple):
    batch, prompts, responses = _batch()
    rows = [torch.tensor([3, 0, 4]), torch.tensor([1, 2])]
    seen = torch.zeros(batch.response_mask.shape, dtype=torch.long)
    for rank in range(cp):
        mbs = build_micro_batches(batch, rows, pad_multiple=multiple, packed=packed, cp_size=cp, cp_rank=rank)
        for mb in mbs:
            b, s_local = mb.input_ids.shape
            assert b == (1 if packed else mb.num_sequences) and s_local * cp == mb.seq_length
            assert mb.seq_length % math.lcm(multiple, 2 * cp if cp > 1 else 1) == 0
            ids, tgt, pos = (t.reshape(-1) for t in (mb.input_ids, mb.targets, mb.position_ids))
            routed = mb.routed_experts.reshape(b * s_local, 1, 2)
            for i, row in enumerate(mb.rows.tolist()):
                p, resp = len(prompts[row]), responses[row].tolist()
                full = prompts[row].tolist() + resp
                for j, tok in enumerate(resp):
                    if not mb.response_mask[i, j]:
                        continue
                    seen[row, j] += 1
                    at = int(mb.logit_index[i, j])
                    assert int(tgt[at]) == tok and int(ids[at]) == full[p - 1 + j]
                    assert int(pos[at]) == p - 1 + j  # RoPE position restarts per sequence
                    assert torch.equal(routed[at], batch.routed_experts[row, p - 1 + j])
                assert not mb.response_mask[i, len(resp):].any()
                assert torch.equal(mb.advantages[i], batch.advantages[row, : mb.advantages.shape[1]])
            assert mb.real_tokens == int(batch.seq_lengths[mb.rows].sum())
            if packed:
                seg = (mb.cu_seqlens_padded[1:] - mb.cu_seqlens_padded[:-1]).long()
                n = mb.num_sequences
                assert int(mb.cu_seqlens_padded[-1]) == mb.seq_length and (seg % (2 if cp > 1 else 1) == 0).all()
                assert torch.equal(seg[:n], packed_lengths(batch.seq_lengths[mb.rows], cp))
                real = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).long()
                assert torch.equal(real[:n], batch.seq_lengths[mb.rows]) and mb.max_seqlen == int(seg.max())
    assert torch.equal(seen, batch.response_mask.long())  # each response token on exactly one CP rank


def test_cp_ranks_hold_megatron_zigzag_chunks_of_the_whole_layout():
    batch, _, _ = _batch(seed=1)
    rows = [torch.arange(5)]
    for packed in (False, True):
        (whole,) = build_micro_batches(batch, rows, packed=packed, cp_size=2, cp_rank=0)
        (one,) = build_micro_batches(batch, rows, packed=packed, pad_multiple=4)  # same length as cp=2 pads to
        parts = [build_micro_batches(batch, rows, packed=packed, cp_size=2, cp_rank=r)[0] for r in (0, 1)]
        if packed:  # each (2*cp-padded) sequence is cut into 4 chunks: rank 0 keeps 0 and 3, rank 1 keeps 1 and 2
            seg = whole.cu_seqlens_padded.tolist()
            expect = [[], []]
            for a, b in zip(seg[:-1], seg[1:]):
                c = (b - a) // 4
                for r in (0, 1):
                    expect[r] += list(range(a + r * c, a + (r + 1) * c)) + list(range(b - (r + 1) * c, b - r * c))
        else:
            c = whole.seq_length // 4
            expect = [list(range(0, c)) + list(range(3 * c, 4 * c)), list(range(c, 3 * c))]
        full_ids = torch.zeros(whole.seq_length, dtype=torch.long)
        for r in (0, 1):
            full_ids.view(-1)[torch.tensor(expect[r])] = parts[r].input_ids[0]
        if not packed:
            assert torch.equal(full_ids, one.input_ids[0, : whole.seq_length])
        else:
            assert int(full_ids.count_nonzero()) == int(batch.seq_lengths.sum())  # ids 1..89, padding 0


def test_same_length_pads_every_stream_to_the_longest():
    batch, _, _ = _batch()
    rows = [torch.tensor([0]), torch.tensor([1, 2, 3, 4])]
    for packed in (False, True):
        mbs = build_micro_batches(batch, rows, packed=packed, same_length=True, pad_multiple=2)
        assert len({mb.seq_length for mb in mbs}) == 1
        short = mbs[0]
        if packed:  # padded at the end as a segment of its own: the real sequence keeps its boundaries
            assert short.cu_seqlens_padded.tolist()[:2] == [0, int(batch.seq_lengths[0])]
            assert int(short.cu_seqlens_padded[-1]) == short.seq_length
