"""The worker's time split: compute, felt communication, waiting (client/timeline.py)."""

import threading

import pytest

from fedgrid.client.timeline import COMM, COMPUTE, Timeline, measure, union


def test_union_and_measure():
    assert union([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0), (5.0, 5.0)]) == [(0.0, 2.0), (3.0, 4.0)]
    assert measure([(0.0, 2.0), (3.0, 4.0)], 1.0, 3.5) == pytest.approx(1.5)


def test_serial_sync_round_splits_into_compute_comm_wait():
    t = Timeline()
    t.add(COMM, 0.0, 2.0)  # download
    t.add(COMPUTE, 2.0, 5.0)  # inner steps
    t.add(COMM, 5.0, 7.0)  # upload; then 3 s waiting for the round to close
    split = t.split(0.0, 10.0)
    assert split == (10.0, 3.0, 4.0, 3.0, 4.0)
    assert split.utilization == pytest.approx(0.3)
    assert split.metrics()["utilization"] == pytest.approx(0.3)


def test_transfer_under_compute_is_hidden():
    t = Timeline()
    t.add(COMPUTE, 0.0, 6.0)  # inner steps going on after the send
    t.add(COMM, 1.0, 4.0)  # upload in flight meanwhile
    t.add(COMM, 5.0, 8.0)  # download, 2 s of it felt
    split = t.split(0.0, 9.0)
    assert (split.compute_s, split.comm_s, split.wait_s, split.transfer_s) == (6.0, 2.0, 1.0, 6.0)


def test_window_forgets_old_intervals_and_records_from_threads():
    clock = iter([1.0, 2.0, 3.0, 4.5]).__next__
    t = Timeline(clock=clock)
    with t.span(COMPUTE):
        pass
    worker = threading.Thread(target=lambda: t.add(COMM, 2.0, 2.5))
    worker.start()
    worker.join()
    with t.span(COMPUTE):
        pass
    assert t.split(0.0, 5.0).compute_s == pytest.approx(2.5)
    assert t.split(2.9, 5.0).compute_s == pytest.approx(1.5)
    assert t.split(0.0, 5.0).compute_s == pytest.approx(1.5)  # the first span was forgotten


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="'idle'"):
        Timeline().add("idle", 0.0, 1.0)


def test_every_client_has_one_timeline():
    from fedgrid.client.api import Client, FitOutput

    class Minimal(Client):
        def fit(self, state, ins):
            return FitOutput(state=state, num_examples=1)

        def evaluate(self, state, config):
            raise NotImplementedError

    client = Minimal()
    assert client.timeline is client.timeline
    assert client.timeline is not Minimal().timeline
