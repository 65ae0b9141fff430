"""The CPU workarounds megatron-core 0.16.1 and later need (each registered with its reason and removal
condition; applied by :func:`megatron_rl.compat.apply`)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from typing import Any, List

import torch

from megatron_rl.compat.registry import _CPU, _cuda_type_queries, _during, _patch, _shim_torch_in, _tensor_cuda_is_identity


@_patch(
    reason="Megatron allocates on torch.cuda.current_device() (RoPE, p2p, memory buffer, DDP, MoE)",
    remove_when="megatron-core takes the device from its config instead of assuming CUDA",
)
def _current_device_is_cpu() -> None:
    # On a CPU build the original raises; answering the CPU device makes `device=...`/`.to(...)` work.
    torch.cuda.current_device = lambda: _CPU


@_patch(
    reason="batched p2p and DDP call torch.cuda.synchronize(); CPU collectives are already synchronous",
    remove_when="megatron-core guards synchronize() with torch.cuda.is_available()",
)
def _synchronize_is_noop() -> None:
    torch.cuda.synchronize = lambda device=None: None


@_patch(
    reason="the tensor-parallel RNG tracker stores and forks CUDA generator states",
    remove_when="megatron-core's CudaRNGStatesTracker supports a CPU generator",
)
def _cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    original = mrandom.CudaRNGStatesTracker
    if getattr(original, "_megatron_rl_cpu", False):
        return

    class CpuRNGStatesTracker(original):
        """Named RNG streams kept as CPU generator states; ``fork`` swaps the CPU default generator."""

        _megatron_rl_cpu = True

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            gen = torch.Generator()
            gen.manual_seed(seed)
            self.states_[name] = gen.get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    # Activation checkpointing saves/restores "the CUDA state": make that the CPU state too.
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, CpuRNGStatesTracker):
        mrandom.initialize_rng_tracker(force_reset=True)  # a CUDA tracker created before apply()


@_patch(
    reason='every pipeline schedule allocates torch.zeros(..., device="cuda") for its token count',
    remove_when="megatron-core's schedules allocate on the model's device",
)
def _schedules_allocate_on_cpu() -> None:
    _shim_torch_in("megatron.core.pipeline_parallel.schedules")


@_patch(
    reason="tying embeddings across pipeline stages calls weight.data.cuda() before the all-reduce",
    remove_when="LanguageModule.setup_embeddings_and_output_layer stops calling .cuda()",
)
def _tied_embedding_stays_on_cpu() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    _during(LanguageModule, "setup_embeddings_and_output_layer", _tensor_cuda_is_identity)


@_patch(
    reason="moe_utils.te_general_gemm is referenced but left undefined when Transformer Engine is absent",
    remove_when="megatron-core >= 0.17 (defines it as None without TE)",
)
def _define_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@_patch(
    reason="the MoE alltoall dispatcher creates CUDA streams/events and leaves split sizes as tensors "
    "unless they live on CUDA (gloo needs host sizes)",
    remove_when="MoEAlltoAllTokenDispatcher handles CPU tensors without streams",
)
def _alltoall_dispatcher_without_streams() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if getattr(MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize, "_megatron_rl_compat", False):
        return
    # A non-None placeholder stops __init__ from creating torch.cuda.Stream().
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        # CPU tensors are host tensors already: only the numpy conversion of the CUDA path remains.
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for attr in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, attr)
                if torch.is_tensor(value):
                    setattr(self, attr, value.numpy())
        return tokens_per_expert

    _maybe_dtoh_and_synchronize._megatron_rl_compat = True
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize


@_patch(
    reason="MoE with expert-TP > 1 all-gathers / reduce-scatters uneven token counts over TP; gloo "
    "only supports equal sizes",
    remove_when="torch's gloo backend supports uneven all_gather / reduce_scatter",
)
def _uneven_sequence_collectives_over_gloo() -> None:
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "_megatron_rl_compat", False):
        return

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        # Pad every rank's part to the largest, gather equal sizes, drop the padding.
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in range(group.size())]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)])

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        # All-reduce everything, keep this rank's rows (CPU: bandwidth is not the concern).
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]].clone()

    _gather_along_first_dim._megatron_rl_compat = True
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


@_patch(
    reason="the optimizer and grad clipping allocate found_inf/scale/norm tensors with device='cuda'",
    remove_when="megatron-core's optimizer allocates on the parameters' device",
)
def _optimizer_allocates_on_cpu() -> None:
    for name in ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads"):
        _shim_torch_in(name)


@_patch(
    reason="the local (no Apex/TE) multi-tensor L2 norm used by grad clipping returns a device='cuda' tensor",
    remove_when="megatron.core.utils.local_multi_tensor_l2_norm allocates on its inputs' device",
)
def _local_l2_norm_on_cpu() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return  # Apex or TE kernels in use

    def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        norms = [[torch.norm(t) for t in tensors] for tensors in tensor_lists]
        return torch.norm(torch.tensor(norms)).reshape(1).float(), None

    clip_grads.l2_norm_impl = local_multi_tensor_l2_norm


@_patch(
    reason="grad clipping, the fp16 optimizer and the distributed optimizer check "
    "Tensor.type() == 'torch.cuda.*Tensor'",
    remove_when="megatron-core checks dtypes instead of CUDA tensor type names",
)
def _optimizer_type_checks_accept_cpu() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    _during(clip_grads, "clip_grad_by_total_norm_fp32", _cuda_type_queries)
    _during(optimizer.Float16OptimizerWithFloat16Params, "__init__", _cuda_type_queries)
    _during(distrib_optimizer.DistributedOptimizer, "__init__", _cuda_type_queries)
    # The optimizer module imported the function by name before we wrapped it.
    if hasattr(optimizer, "clip_grad_by_total_norm_fp32"):
        optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32



@_patch(
    reason="loading a 'fully_reshardable' distributed-optimizer checkpoint into torch's Adam (no Apex/TE "
    "FusedAdam, as on CPU) copies every state key of the destination, 'step' included, from a source "
    "that deliberately omits it (KeyError: 'step'); the step is restored from the param groups anyway",
    remove_when="DistributedOptimizer._set_main_param_and_optimizer_states skips keys the source lacks",
)
def _fully_reshardable_load_keeps_step() -> None:
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states
    if getattr(original, "_megatron_rl_compat", False):
        return

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main_param]
            if "step" in state:  # already set from the param groups by load_state_dict(): keep it
                tensors = dict(tensors, step=state["step"].clone())
        return original(self, model_param, tensors)

    _set_main_param_and_optimizer_states._megatron_rl_compat = True
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


@_patch(
    reason="context parallelism slices the RoPE table with an index tensor built with pin_memory=True and "
    ".cuda() (get_pos_emb_on_this_cp_rank)",
    remove_when="rope_utils.get_pos_emb_on_this_cp_rank builds its index on the table's device",
)
def _rope_cp_slice_on_cpu() -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    if getattr(rope_utils.get_pos_emb_on_this_cp_rank, "_megatron_rl_compat", False):
        return

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        size, rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, index)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    get_pos_emb_on_this_cp_rank._megatron_rl_compat = True
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


@_patch(
    reason="the unfused RoPE of packed (THD) sequences loops over the sequences in Python (a .item() and "
    "two slices per sequence, per layer, for q and k): the overhead outweighs packing's saving on short "
    "sequences; this computes the same frequency gather in a few vectorised ops (bitwise the same values)",
    remove_when="rope_utils._apply_rotary_pos_emb_thd is vectorised (or RoPE fusion runs on CPU)",
)
def _vectorised_thd_rope() -> None:
    from megatron.core.models.common.embeddings import rope_utils

    if getattr(rope_utils._apply_rotary_pos_emb_thd, "_megatron_rl_compat", False):
        return
    last: List[Any] = [None, None, None]  # (cu_seqlens object, key, positions): q and k of every layer share it

    def positions(cu_seqlens, n: int, size: int, rank: int, stream_freqs: bool, device, table: int) -> torch.Tensor:
        key = (n, size, rank, stream_freqs, device, table)
        if last[0] is cu_seqlens and last[1] == key:
            return last[2]
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        full = cu[1:] - cu[:-1]
        local = full // size  # each sequence's rows on this CP rank, back to back
        seq = torch.repeat_interleave(torch.arange(len(local), device=device), local, output_size=n)
        index = torch.arange(n, device=device) - (torch.cumsum(local, 0) - local)[seq]
        pos = index
        if size > 1:  # zigzag: chunks rank and 2*size-1-rank of the sequence (Megatron's CP layout)
            half = (local // 2)[seq]
            pos = torch.where(index < half, rank * half + index, full[seq] - (rank + 1) * half + index - half)
        if stream_freqs:  # freqs for every stream position: offset by the sequence start
            pos = pos + cu[:-1][seq]
        last[:] = [cu_seqlens, key, pos]
        return pos

    def _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=False, mscale=1.0, cp_group=None,
                                  **mla):  # the MLA flag under either version's name (see fused_layer._rope_bshd)
        if cp_group is None:
            raise ValueError("cp_group must be provided for THD format RoPE")
        # int(cu_seqlens[-1]) is a device sync: once per micro-batch (the layers share cu_seqlens), not per call
        if last[0] is cu_seqlens and last[1] is not None and last[1][-1] == freqs.size(0):
            stream_freqs = last[1][3]
        else:
            stream_freqs = freqs.size(0) == int(cu_seqlens[-1])
        pos = positions(cu_seqlens, t.shape[0], cp_group.size(), cp_group.rank(), stream_freqs, t.device,
                        freqs.size(0))
        # looked up per call: models.fused_layer.install_rope may route it through its compiled copy
        bshd = rope_utils._apply_rotary_pos_emb_bshd
        return bshd(t.unsqueeze(1), freqs[pos], rotary_interleaved=rotary_interleaved, mscale=mscale,
                    **mla).squeeze(1)

    _apply_rotary_pos_emb_thd._megatron_rl_compat = True
    rope_utils._apply_rotary_pos_emb_thd = _apply_rotary_pos_emb_thd


@_patch(
    reason="without Transformer Engine, multi_latent_attention imports TE's names as MagicMock placeholders and "
    "sets HAVE_TE=True, so MLASelfAttention's isinstance(linear_proj, TELinear) raises TypeError",
    remove_when="multi_latent_attention sets HAVE_TE from transformer_engine's real presence",
)
def _mla_without_transformer_engine() -> None:
    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


# The patches only newer megatron-core releases need (registered on import, after the ones above).
