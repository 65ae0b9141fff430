"""Bars for work inside Ray actors: an actor reports through a Reporter, the driver draws while waiting."""

from __future__ import annotations

import io

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class _Worker:
    def run(self, reporter, steps: int) -> int:
        import time

        for k in range(1, steps + 1):
            reporter("train micro-batches", k, steps, "mb")
            time.sleep(0.15)
        for sent in (1 << 20, 3 << 20):
            reporter("weight sync", sent, 3 << 20, "B")
            time.sleep(0.3)
        return steps


def test_actor_reports_drawn_by_driver(local_ray, monkeypatch):
    from tqdm import tqdm

    from megatron_rl.orchestration import progress as progress_mod

    bars = []

    def recording_bar(total, desc, enabled, unit="it", scale=False):
        bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, file=io.StringIO(), mininterval=0)
        bars.append(bar)
        return bar

    monkeypatch.setattr(progress_mod, "progress", recording_bar)
    board = progress_mod.ProgressBoard(poll_s=0.05)
    try:
        worker = _Worker.remote()
        assert board.wait([worker.run.remote(board.reporter(), 5)]) == [5]
    finally:
        board.close()
    final = {b.desc: (b.n, b.total, b.unit) for b in bars}
    # the last report of each bar always goes through (throttling only drops intermediate ones)
    assert final == {"train micro-batches": (5, 5, "mb"), "weight sync": (3 << 20, 3 << 20, "B")}
    assert all(b.disable for b in bars)  # closed when the call returned


def test_reporter_throttles_intermediate_reports():
    from megatron_rl.orchestration.progress import Reporter

    sent = []

    class _Remote:
        def remote(self, *a):
            sent.append(a)

    class _Board:
        report = _Remote()

    r = Reporter(_Board(), min_interval_s=60.0)
    for k in range(1, 11):
        r("x", k, 10)
    assert sent == [("x", 1, 10, "it"), ("x", 10, 10, "it")]
