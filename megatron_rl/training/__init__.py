"""The trainer: forward/backward through Megatron's pipeline schedules, optimizer, checkpoints.

  config.py      OptimConfig, TrainConfig (validated dataclasses)
  batch.py       TrainBatch (per-sequence tokens, per-response-token tensors)
  micro_batch.py MicroBatch: padded rows or a packed stream, this context-parallel rank's zigzag share
  token_budget.py token-budget micro-batches, work balanced over data-parallel ranks (pure functions)
  loss_glue.py   sharded logits + micro-batch -> token statistics -> LossInputs -> rl_loss
  pipeline.py    run micro-batches through get_forward_backward_func
  optim.py       Megatron DDP + optimizer; the guarded (skip-on-non-finite) optimizer step
  trainer.py     PolicyTrainer: forward() and train_step(); the loss-scaling derivation
  trainer_batches.py  its micro-batches of a batch (fixed count or token budget), batch checks and metrics
  trainer_passes.py   its passes besides the train step: reference logits, statistics, result assembly
  routing.py     the PolicyTrainer's MoE routing glue: replay contexts for every pass, metrics, the mask's input
  results.py     StepResult, ForwardResult, metric merging
  head.py        the fused output layer (train.fused_head): the loss from the output layer's input and weight
  checkpoint.py  dist-checkpointing save/load: atomic, resharding, keep-last-K
  checkpoint_integrity.py  checkpoint integrity checks and disk space
  fused_optim.py multi-tensor optimizer helpers for runs without Transformer Engine or Apex
  nan_guard.py   whether an Adam(W) step can make the weights non-finite, decided before it is taken
  placement.py   a micro-batch to the device once (one pass over its fields); results back once
  offload.py     TrainerOffload: optimizer state + gradient buffers to host memory and back (colocated)
"""

from megatron_rl.config.train import OptimConfig, TrainConfig
from megatron_rl.training.batch import MicroBatch, TrainBatch, make_micro_batches
from megatron_rl.training.results import ForwardResult, StepResult
from megatron_rl.training.trainer import PolicyTrainer

__all__ = ["ForwardResult", "MicroBatch", "OptimConfig", "PolicyTrainer", "StepResult", "TrainBatch", "TrainConfig",
           "make_micro_batches"]
