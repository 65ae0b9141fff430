"""Trainer -> engine weight transport.

  receiver.py        WeightReceiver: what an engine implements to take part in a sync (updates, probe
                     log-probs, its dtype, in-place receipt); the sync never type-tests engines
  group.py           the torch.distributed group that broadcasts weights trainer -> engines
  links.py           per-rank links: each trainer rank sends its own pieces to the sender (no full gather)
  tensor_payload.py  SGLang's /update_weights_from_tensor payloads: tensors by handle (CUDA IPC / shm files)
  probe.py           the post-sync check: one probe sequence's log-probs, trainer vs engine
  (config)           WeightSyncConfig, the run config's weight_sync section, is megatron_rl/config/rollout.py's
  sync.py            WeightSync: Megatron shards -> engine in size-bounded HF-named buckets, then the probe
  transaction.py     one sync as a stage -> verify -> commit transaction over the engines (per-engine outcome)
  transactional_sync.py  TransactionalSync: WeightSync driving that transaction (RemoteEngine transports)
  deadline.py        the sync's deadline, per-call bounds, the watchdog that aborts a stuck group
  checksum.py        a bucket's exact integer checksum, verified by the receiving server
"""
