"""HF config -> Megatron-Core GPTModel (dense and MoE), layer specs, HF <-> Megatron weights, routing.

  config.py   ModelConfig (the user's model section), HFArch (validated HF architecture),
              HF -> TransformerConfig, padded vocabulary
  spec.py     layer specs: Transformer Engine on GPU, portable torch spec (SDPA attention, RMSNorm)
  attention.py  the portable core attention: SDPA over padded or packed (THD) input, context parallelism
  packed_attention.py  packed (THD) attention in one call per layer: varlen (CUDA), padded SDPA, plans
  build.py    build_model(): this rank's pipeline stage, weights loaded
  built.py    BuiltModel (what build_model returns), ShardLayout, Axis
  mapping.py  HF <-> Megatron names, shapes and sharding kinds (pure)
  weights.py  load_hf_weights(), iter_hf_weights() (streaming export), save_hf_checkpoint()
  router.py   MoE routing record / replay (RouterReplay wrapper)
  shards.py   what each trainer rank owns of the HF weights: (Piece, tensor) pairs, no communication
  deepseek.py DeepSeek-V3-style models: MLA, shared expert, sigmoid router with expert bias (MTP ignored)
  glm.py      GLM-4.5-style MoE: qkv bias, q/k norm, partial RoPE, DeepSeek-V3's router
  qwen3_next.py  Qwen3-Next-style hybrid (Gated-DeltaNet): config + weight mapping; not buildable yet (why inside)
"""

from megatron_rl.models.config import SUPPORTED_MODEL_TYPES, HFArch, ModelConfig, padded_vocab_size

__all__ = ["SUPPORTED_MODEL_TYPES", "HFArch", "ModelConfig", "padded_vocab_size"]
