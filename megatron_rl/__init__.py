"""megatron_rl: RL post-training of LLMs on Megatron-Core with vocabulary-sharded losses.

Tour:
  ops/          vocabulary-parallel autograd Functions (log-probs, entropy, sum pi^2, DVP, exact KL)
  parallel.py   torch.distributed + Megatron parallel_state set-up; explicit process groups
  compat.py     the CPU compatibility layer for Megatron-Core (applied only without CUDA)
  models/       HF config -> Megatron GPTModel (dense, MoE), layer specs, HF <-> Megatron weights,
                MoE routing record / replay
  testing.py    run a function on N gloo processes (tests, benchmarks)
  diagnostics.py  the gain decomposition of an update (math_spec §h) and reward bits per episode (§i)
  report.py     ``megatron-rl report RUN_DIR``: one HTML page of PNG plots of a run
  export.py     ``megatron-rl export CHECKPOINT_DIR OUT_DIR``: any trainer checkpoint -> HF directory
"""

__version__ = "0.1.0"
