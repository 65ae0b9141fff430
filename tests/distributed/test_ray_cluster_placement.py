"""Multi-node Ray on one machine (ray.cluster_utils.Cluster): the wait-for-all-nodes helper and
placement across nodes, as the SLURM launch uses them.

Three Ray nodes with one CPU each, tagged like the sbatch script tags them (``slurm_node:<name>``).
Light on purpose (2-core CI): no dashboard, small object stores, one cluster for the module.
"""

import os
import shutil
import tempfile
import threading
import time

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from megatron_rl.launch.ray_cluster import cluster_shortfall, wait_for_cluster  # noqa: E402

NODE_ARGS = dict(num_cpus=1, object_store_memory=80 * 1024**2)


@pytest.fixture(scope="module")
def cluster():
    # A short private temp dir: unix socket paths under pytest's tmp_path exceed the 107-byte limit.
    # RAY_TMPDIR too: Cluster writes (and on shutdown deletes) "<default temp dir>/ray_current_cluster",
    # which a concurrent bare ray.init() elsewhere on the machine would otherwise connect to.
    private = tempfile.mkdtemp(prefix="rc-", dir="/tmp")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_TMPDIR", private)
    mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
    c = None
    try:
        c = Cluster(initialize_head=True, head_node_args=dict(NODE_ARGS, resources={"slurm_node:a": 1},
                                                              include_dashboard=False, temp_dir=os.path.join(private, "ray")))
        for name in ("b", "c"):
            c.add_node(**NODE_ARGS, resources={f"slurm_node:{name}": 1})
        ray.init(address=c.address, logging_level="warning", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        if c is not None:
            c.shutdown()
        mp.undo()
        shutil.rmtree(private, ignore_errors=True)


def test_wait_returns_once_all_nodes_and_tags_are_there(cluster):
    nodes = wait_for_cluster(3, per_node={"CPU": 1}, tags=["slurm_node:a", "slurm_node:b", "slurm_node:c"], timeout_s=30)
    assert len(nodes) == 3


def test_wait_names_what_is_missing(cluster):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        wait_for_cluster(4, per_node={"CPU": 2}, tags=["slurm_node:a", "slurm_node:d"], timeout_s=1.5, poll_s=0.5)
    msg = str(e.value)
    assert 1.5 <= time.monotonic() - t0 < 10
    assert "3 of 4 nodes joined" in msg
    assert "'slurm_node:d'" in msg and "'slurm_node:a'" not in msg
    assert "node a (" in msg and "CPU=1 (expected 2)" in msg


def test_wait_blocks_until_a_late_node_joins(cluster):
    result = {}

    def waiter():
        try:
            result["nodes"] = wait_for_cluster(4, tags=["slurm_node:late"], timeout_s=60, poll_s=0.2)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(1.0)
    assert t.is_alive(), f"returned before the node joined: {result}"
    node = cluster.add_node(**NODE_ARGS, resources={"slurm_node:late": 1})
    try:
        t.join(60)
        assert not t.is_alive() and "error" not in result, result
        assert len(result["nodes"]) == 4
    finally:
        cluster.remove_node(node)
    # the removed node is reported dead; the cluster is back to three
    deadline = time.monotonic() + 30
    while len([n for n in ray.nodes() if n["Alive"]]) != 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not cluster_shortfall(ray.nodes(), 3, tags=["slurm_node:a", "slurm_node:b", "slurm_node:c"])


@ray.remote(num_cpus=1)
class WhereAmI:
    def node(self):
        ctx = ray.get_runtime_context()
        return ctx.get_node_id()


def test_strict_spread_places_one_actor_per_node(cluster):
    pg = placement_group([{"CPU": 1}] * 3, strategy="STRICT_SPREAD")
    try:
        assert pg.wait(timeout_seconds=60), "a 3-bundle STRICT_SPREAD group did not fit on 3 nodes"
        actors = [WhereAmI.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)).remote()
                  for i in range(3)]
        node_ids = ray.get([a.node.remote() for a in actors], timeout=60)
        assert len(set(node_ids)) == 3
        # each landed on a different tagged node: map node ids to their slurm_node tag
        tags = {n["NodeID"]: next(k for k in n["Resources"] if k.startswith("slurm_node:")) for n in ray.nodes() if n["Alive"]}
        assert sorted(tags[i] for i in node_ids) == ["slurm_node:a", "slurm_node:b", "slurm_node:c"]
        for a in actors:
            ray.kill(a)
    finally:
        remove_placement_group(pg)


def test_strict_spread_wider_than_the_cluster_does_not_fit(cluster):
    pg = placement_group([{"CPU": 0.1}] * 4, strategy="STRICT_SPREAD")
    try:
        assert not pg.wait(timeout_seconds=2), "4 STRICT_SPREAD bundles placed on 3 nodes"
    finally:
        remove_placement_group(pg)


def test_shortfall_without_ray():
    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"GPU": 8, "slurm_node:n1": 1}},
             {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"GPU": 4, "slurm_node:n2": 1}},
             {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"GPU": 8, "slurm_node:n3": 1}}]
    problems = cluster_shortfall(nodes, 3, {"GPU": 8}, ["slurm_node:n1", "slurm_node:n2", "slurm_node:n3"])
    assert problems == ["2 of 3 nodes joined",
                        "no node with resource 'slurm_node:n3' (that node's Ray did not join; see its log)",
                        "node n2 (10.0.0.2) offers GPU=4 (expected 8)"]
    assert cluster_shortfall(nodes[:2], 2, {"GPU": 4}) == []
