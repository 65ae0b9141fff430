"""``megatron-rl plan``: predicted step time, tokens/s/GPU and MFU of candidate layouts, placements and rollout
modes, from an explicit cost model, before a cluster is spent.

  devices.py      vendor peaks (FLOP/s, HBM bandwidth, links, memory) of H100 / H200 / B200, and this CPU
  cost_model.py   the step's phases from FLOPs, bytes and bandwidths, and how the rollout mode overlaps them
  calibration.py  the measured efficiencies a ``bench`` run writes (``calibration.json``) and the planner reads
  planner.py      candidates (TP/PP/EP x colocated / split x sync / one-step / async k), ranking, printing
"""
