"""Launching runs on clusters: SLURM sbatch files rendered from a typed config, Ray cluster helpers.

* :mod:`megatron_rl.launch.slurm` - :class:`SlurmConfig`, :func:`render_sbatch`, :func:`submit`.
* :mod:`megatron_rl.launch.sbatch_template` - the sbatch template it renders.
* :mod:`megatron_rl.launch.ray_cluster` - wait until every node (and its GPUs) joined a Ray cluster,
  find/stop the processes of one Ray cluster by its temp dir (never by process name).
"""
