"""The staleness bound of asynchronous RL (orchestration/staleness.py), property-tested over random schedules.

A simulated engine generates the admitted groups token by token (random long-tailed lengths, any interleaving
hypothesis picks), tagging each token with the version it holds; a simulated trainer takes batches, trains,
and publishes each step's weights -- in place while groups are mid-generation (partial rollouts) or after
they drain. Checked at every step: no trained token is more than ``max_staleness`` versions old, no group with
signal is ever dropped, dropped groups are only the all-equal ones of filtering steps, and the run never
deadlocks (some action always makes progress until every step has trained).
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.orchestration.staleness import StalenessController, StalenessError


class Sim:
    def __init__(self, data, B, k, order, partial, budget, steps):
        self.data, self.steps, self.partial, self.budget = data, steps, partial, budget
        self.c = StalenessController(B, k, order=order)
        self.k = k
        self.version = 0  # what the engine serves
        self.groups = {}  # index -> dict(length, signal, tokens: [versions])
        self.trainer = "idle"  # idle -> training -> publishing -> idle
        self.step = 0  # last step taken
        self.takes = []
        self.filtering = None

    def admit(self):
        if self.trainer == "publishing" and not self.partial:
            return  # a publish without partial rollouts drains: nothing new starts
        while self.c.capacity() > 0:
            slot = self.c.admit()
            # long tail: most groups short, some 8x longer
            length = self.data.draw(st.sampled_from([1, 2, 3, 4, 24]), label="length")
            self.groups[slot.index] = dict(length=length, signal=self.data.draw(st.booleans(), label="signal"),
                                           tokens=[], done=False)

    def running(self):
        return [i for i, g in self.groups.items() if not g["done"] and i in self.c.slots]

    def actions(self):
        out = []
        running = self.running()
        growing = [i for i in running if len(self.groups[i]["tokens"]) < self.groups[i]["length"]]
        if growing:
            out.append("token")
        if any(len(self.groups[i]["tokens"]) == self.groups[i]["length"] for i in running):
            out.append("finish")
        if self.trainer == "idle":
            out.append("take")
        if self.trainer == "training":
            out.append("trained")
        if self.trainer == "publishing" and (self.partial or not running):
            out.append("publish")
        return out

    def do(self, action):
        """Returns whether the action made progress."""
        running = self.running()
        if action == "token":
            growing = [i for i in running if len(self.groups[i]["tokens"]) < self.groups[i]["length"]]
            i = self.data.draw(st.sampled_from(growing), label="grow")
            self.groups[i]["tokens"].append(self.version)
        elif action == "finish":
            i = self.data.draw(st.sampled_from([i for i in running if len(self.groups[i]["tokens"])
                                                == self.groups[i]["length"]]), label="finish")
            self.groups[i]["done"] = True
            self.c.finish(i, self.groups[i]["signal"])
        elif action == "take":
            if self.filtering is None:  # a step filters (dynamic sampling) or not (warm-up), once for all its tries
                self.filtering = self.data.draw(st.booleans(), label="filter")
            filtering = self.filtering
            capacity = self.c.capacity()
            take = self.c.take(filter_groups=filtering, budget=self.budget)
            if take is None:
                return self.c.capacity() > capacity  # it dropped groups: their slots admit new ones
            self.check(take, filtering)
            self.step, self.trainer, self.filtering = take.step, "training", None
        elif action == "trained":
            self.trainer = "publishing"
        elif action == "publish":
            self.version = self.step  # the weights trained at step s are version s
            self.c.publish(self.version)
            self.trainer = "idle"
        return True

    def check(self, take, filtering):
        assert take.step == self.step + 1
        trained_with = take.step - 1  # step s trains with the weights published after step s - 1
        for i in take.batch:
            g = self.groups[i]
            assert g["done"] and len(g["tokens"]) == g["length"]
            for v in g["tokens"]:
                assert trained_with - v <= self.k, (i, g["tokens"], take.step)
            if filtering:  # (steps that do not filter, e.g. the warm-up, train all-equal groups too)
                assert g["signal"]
        for i in take.dropped:
            assert not self.groups[i]["signal"] and self.groups[i]["done"]  # only finished all-equal groups
        self.takes.append((take.step, list(take.batch), list(take.dropped)))

    def run(self):
        self.admit()
        for _ in range(5000):
            if self.step == self.steps and self.trainer == "idle":
                return
            acts = self.actions()
            first = self.data.draw(st.integers(0, len(acts) - 1), label="action")
            # the drawn action, or the next one that makes progress: a deadlock is a state where none does
            for a in acts[first:] + acts[:first]:
                if self.do(a):
                    break
            else:
                raise AssertionError(f"deadlock at step {self.step}: {self.c.state_dict()}")
            self.admit()
        raise AssertionError("no end after 5000 actions")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), B=st.integers(1, 4), k=st.integers(1, 3), order=st.sampled_from(["fifo", "ready"]),
       partial=st.booleans(), rounds=st.integers(0, 3), steps=st.integers(1, 8))
def test_staleness_bound_holds_over_random_schedules(data, B, k, order, partial, rounds, steps):
    Sim(data, B, k, order, partial, B * (1 + rounds), steps).run()


@pytest.mark.parametrize("drop_every,budget", [(5, 9), (1, 3)])  # (1, 3): every group all-equal, steps give up
def test_fifo_batches_do_not_depend_on_timing(drop_every, budget):
    """Without partial rollouts the FIFO order makes every admission (its version) and every step's batch and
    drops a function of the groups' outcomes only: runs whose generations finish in different orders, and whose
    stream admits at different moments, admit and train the same groups."""
    import random

    def run(seed):
        rng = random.Random(seed)
        c = StalenessController(3, 2, order="fifo")
        signal = {i: i % 5 != 2 if drop_every == 5 else False for i in range(2000)}  # the same outcomes
        versions, takes, running = {}, [], []

        def admit():
            while c.capacity():
                slot = c.admit()
                running.append(slot.index)
                versions[slot.index] = slot.version

        admit()
        for step in range(1, 9):
            while True:
                for _ in range(rng.randrange(3)):  # some generations finish, in any order
                    if running:
                        i = running.pop(rng.randrange(len(running)))
                        c.finish(i, signal[i])
                take = c.take(filter_groups=True, budget=budget)
                if rng.random() < 0.5 or take is not None:  # the stream admits now, or later
                    admit()
                if take is not None:
                    break
            takes.append((take.step, take.batch, take.dropped))
            while running:  # the publish drains the generations in flight
                i = running.pop(rng.randrange(len(running)))
                c.finish(i, signal[i])
            c.publish(step)
            admit()
        return versions, takes

    assert run(0) == run(1) == run(2) == run(3)


def test_admission_capacity_and_errors():
    c = StalenessController(2, 1)
    assert c.capacity() == 4  # (u + k + 1 - C) * B with u = C = 0
    slots = [c.admit() for _ in range(4)]
    assert c.capacity() == 0 and [s.version for s in slots] == [0, 0, 0, 0]
    with pytest.raises(StalenessError):
        c.admit()
    for s in slots[:2]:
        c.finish(s.index)
    take = c.take(filter_groups=False, budget=2)
    assert take.step == 1 and take.batch == [0, 1]
    assert c.capacity() == 0  # the freed slots open only when version 1 is published
    c.publish(1)
    assert c.capacity() == 2
    with pytest.raises(ValueError, match="max_staleness=0"):
        StalenessController(2, 0)
    state = c.state_dict()
    d = StalenessController(2, 1)
    d.load_state_dict(state)
    assert d.state_dict() == state and d.capacity() == 2
    with pytest.raises(ValueError, match="same rollout settings"):
        StalenessController(3, 1).load_state_dict(state)


def _sample(spans, finish="length"):
    from megatron_rl.rollout.client.protocol import Sample
    from megatron_rl.rollout.client.weight_versions import WeightVersionSpan

    n = spans[-1][2]
    return Sample([1], list(range(n)), [0.0] * n, finish, weight_version=spans[-1][0],
                  weight_versions=[WeightVersionSpan(*s) for s in spans])


def test_staleness_metrics_count_trained_tokens():
    from megatron_rl.orchestration.staleness import staleness_metrics

    samples = [_sample([("3", 0, 4), ("4", 4, 6)]),  # spans versions 3 and 4
               _sample([("2", 0, 2)]),
               _sample([("4", 0, 2)]),
               _sample([("1", 0, 7)], finish="abort")]  # masked out of the loss: not counted
    m = staleness_metrics(samples, step=5, max_staleness=2)  # step 5 trains with version 4
    stale = [1, 1, 1, 1, 0, 0] + [2, 2] + [0, 0]
    assert m["rollout/staleness_mean"] == pytest.approx(sum(stale) / len(stale))
    assert m["rollout/staleness_max"] == 2.0
    assert [m[f"rollout/staleness_frac_{j}"] for j in range(3)] == pytest.approx([0.4, 0.4, 0.2])
    assert m["rollout/partial_frac"] == pytest.approx(1 / 3)
    assert staleness_metrics([_sample([("default", 0, 3)])], step=1, max_staleness=0) == {
        "rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0, "rollout/partial_frac": 0.0,
        "rollout/staleness_frac_0": 1.0}


def test_busy_meter_and_idle_fractions(monkeypatch):
    from megatron_rl.orchestration import activity

    now = [0.0]
    monkeypatch.setattr(activity.time, "perf_counter", lambda: now[0])
    meter = activity.BusyMeter()
    with meter.busy():  # 0..4 busy, with a second request 1..2 overlapping (counted once)
        now[0] = 1.0
        with meter.busy():
            now[0] = 2.0
        meter.suspend()  # 2..3 paused: not busy
        now[0] = 3.0
        meter.resume()
        now[0] = 4.0
    now[0] = 10.0  # idle
    assert meter.since_last() == pytest.approx(3.0) and meter.since_last() == 0.0
    from megatron_rl import perf

    m = perf.step_metrics({"time/step": 10.0, "time/train": 2.0, "time/logprobs": 1.0, "time/weight_sync": 1.0,
                           "time/rollout": 9.0}, None, perf.Devices(trainer=1, engine=1, colocated=False), None,
                          engine_busy_s=3.0)
    assert m["perf/engine_idle_frac"] == pytest.approx(0.7) and m["perf/trainer_idle_frac"] == pytest.approx(0.6)
