"""``megatron-rl bench``: throughput benchmarks of a recipe's model, layout, placement and rollout mode on a
synthetic workload, with no dataset and no download.

  workload.py  prompt / response length distributions (fixed, lognormal, empirical) and the prompt file
  model.py     a random-weight HF model (+ a word-level tokenizer) from an HF config (``bench.model_config``)
  reward.py    the bench's reward: cheap, deterministic, varies within a group (advantages are not all zero)
  runner.py    recipe + overrides + workload -> a run of the RL loop; its own ``metrics.jsonl`` rows
  summary.py   median and spread of the timed steps (warm-up excluded): table.md, bench.json, plots
  sweep.py     ``--sweep key=v1,v2 ...``: the grid, one run per point, and the scaling table
"""
