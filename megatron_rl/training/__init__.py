"""Train engine: forward/backward through Megatron's pipeline schedules, optimizer, checkpoints.

  config.py      OptimConfig, TrainConfig (validated dataclasses)
  batch.py       TrainBatch (per-sequence tokens, per-response-token tensors)
  micro_batch.py MicroBatch: padded rows or a packed stream, this context-parallel rank's zigzag share
  schedule.py    token-budget micro-batches, work balanced over data-parallel ranks (pure functions)
  loss_glue.py   sharded logits + micro-batch -> token statistics -> LossInputs -> rl_loss
  pipeline.py    run micro-batches through get_forward_backward_func
  optim.py       Megatron DDP + optimizer; the guarded (skip-on-non-finite) optimizer step
  engine.py      PolicyTrainer: forward() and train_step(); the loss-scaling derivation
  results.py     StepResult, ForwardResult, metric merging
  checkpoint.py  dist-checkpointing save/load: atomic, resharding, keep-last-K
  offload.py     TrainerOffload: optimizer state + gradient buffers to host memory and back (colocated)
"""

from megatron_rl.training.batch import MicroBatch, TrainBatch, make_micro_batches
from megatron_rl.config.train import OptimConfig, TrainConfig
from megatron_rl.training.engine import PolicyTrainer
from megatron_rl.training.results import ForwardResult, StepResult

__all__ = ["ForwardResult", "MicroBatch", "OptimConfig", "PolicyTrainer", "StepResult", "TrainBatch", "TrainConfig",
           "make_micro_batches"]
