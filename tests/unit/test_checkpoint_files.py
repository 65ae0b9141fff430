"""Checkpoint directory bookkeeping: the ``latest`` pointer, listing, retention, config validation."""

import os

import pytest

from megatron_rl.training import checkpoint as ck


def _make(root, *steps):
    for s in steps:
        os.makedirs(os.path.join(root, ck.iter_name(s)))


def test_pointer_listing_and_retention(tmp_path):
    root = str(tmp_path)
    assert ck.latest_checkpoint(root) is None and ck.list_checkpoints(root) == []
    _make(root, 3, 10, 7, 12)
    os.makedirs(os.path.join(root, ".tmp_iter_0000013"))  # an unfinished save is not a checkpoint
    assert ck.list_checkpoints(root) == [3, 7, 10, 12]
    ck._write_pointer(root, ck.iter_name(12))
    assert ck.latest_checkpoint(root) == os.path.join(root, "iter_0000012")
    assert not os.path.exists(os.path.join(root, "latest.tmp"))
    ck._prune(root, keep_last=2, protect="iter_0000012")
    assert ck.list_checkpoints(root) == [10, 12]
    ck._prune(root, keep_last=0, protect="iter_0000012")  # 0 keeps everything
    assert ck.list_checkpoints(root) == [10, 12]
    # Resumed from step 10 of an abandoned run that reached 12: the new save at 11 survives pruning.
    _make(root, 11)
    ck._prune(root, keep_last=1, protect="iter_0000011")
    assert ck.list_checkpoints(root) == [11, 12]


def test_pointer_to_a_missing_directory_is_an_error(tmp_path):
    ck._write_pointer(str(tmp_path), "iter_0000004")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        ck.latest_checkpoint(str(tmp_path))


@pytest.mark.parametrize("kwargs, match", [
    (dict(root=""), "root"),
    (dict(root="x", keep_last=-1), "keep_last"),
    (dict(root="x", optimizer_format="fully_sharded_model_space"), "optimizer_format"),
])
def test_checkpoint_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ck.CheckpointConfig(**kwargs)
