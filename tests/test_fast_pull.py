"""``federation.fast_pull``: Flower's object pulls retry after 0.05 s (doubling to 0.5 s) instead of 1 s,
bounded by Flower's total time; the objects and the errors are Flower's."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

pytestmark = pytest.mark.flower


@pytest.fixture
def flower_modules(monkeypatch):
    import flwr.supercore.inflatable.inflatable_utils as iu
    import flwr.supernode.start_client_internal as sic

    # restored after the test: patch() rebinds these names
    monkeypatch.setattr(iu, "pull_objects", iu.pull_objects)
    monkeypatch.setattr(sic, "pull_objects", sic.pull_objects)
    return iu, sic


def test_pulls_retry_sooner_and_keep_flowers_objects_and_errors(flower_modules, monkeypatch):
    iu, sic = flower_modules
    from fedhisto.federation.fast_pull import patch

    real = iu.pull_objects
    seen = []

    def recorder(ids, fn, **kw):  # stands for Flower's function: records what it is called with
        seen.append(kw)
        return real(ids, fn, **kw)

    monkeypatch.setattr(iu, "pull_objects", recorder)
    monkeypatch.setattr(sic, "pull_objects", iu.pull_objects)
    patch(("flwr.supernode.start_client_internal",))
    assert sic.pull_objects is iu.pull_objects

    tries = {"a": 0, "b": 0}

    def pull(object_id: str) -> bytes:  # each object arrives after two "not there yet"
        tries[object_id] += 1
        if tries[object_id] <= 2:
            raise iu.ObjectUnavailableError(object_id)
        return object_id.encode() * 3

    assert sic.pull_objects(["a", "b"], pull) == {"a": b"aaa", "b": b"bbb"}
    assert tries == {"a": 3, "b": 3}
    assert seen[-1]["initial_backoff"] == 0.05 and seen[-1]["backoff_cap"] == 0.5
    assert seen[-1]["max_tries_per_object"] is None  # bounded by max_time, as Flower's defaults are in effect

    # an object that never comes still fails as Flower's does, within the caller's max_time
    with pytest.raises(iu.ObjectPullError):
        iu.pull_objects(["never"], lambda oid: (_ for _ in ()).throw(iu.ObjectUnavailableError(oid)), max_time=0.3)
    # a caller's shorter backoff is kept; patching twice wraps Flower's function once
    patch()
    iu.pull_objects(["a"], lambda oid: b"x", initial_backoff=0.01)
    assert seen[-1]["initial_backoff"] == 0.01 and iu.pull_objects.flower_pull_objects is recorder


def test_a_module_without_flowers_pull_objects_is_refused(flower_modules):
    from fedhisto.federation.fast_pull import patch

    with pytest.raises(RuntimeError, match="no pull_objects"):
        patch(("json",))


def test_the_supernode_heartbeat_interval_is_set_where_flower_reads_it_and_refused_out_of_range(monkeypatch):
    """What the SuperNode announces (the SuperLink's offline deadline is twice it) and what its sender waits
    between heartbeats are both Flower's module constant, read at call time."""
    import flwr.supercore.heartbeat as sender
    import flwr.supernode.fleet_http_connection as connection

    from fedhisto.federation.supernode_poll import set_heartbeat

    monkeypatch.setattr(sender, "HEARTBEAT_DEFAULT_INTERVAL", sender.HEARTBEAT_DEFAULT_INTERVAL)
    monkeypatch.setattr(connection, "HEARTBEAT_DEFAULT_INTERVAL", connection.HEARTBEAT_DEFAULT_INTERVAL)
    assert connection.HEARTBEAT_DEFAULT_INTERVAL == 30  # Flower's default, what an unset variable keeps
    set_heartbeat(10.0)
    assert sender.HEARTBEAT_DEFAULT_INTERVAL == connection.HEARTBEAT_DEFAULT_INTERVAL == 10.0
    waits = []

    class Stop:  # stops the sender's loop after its first wait
        def is_set(self):
            return bool(waits)

        def wait(self, seconds):
            waits.append(seconds)
            return True

    beat = sender.HeartbeatSender(lambda: True)
    beat._stop_event = Stop()
    beat._run()  # one heartbeat, then the wait before the next: (10 - 5 s call timeout) x 0.8 +- 0.1
    assert len(waits) == 1 and 3.5 <= waits[0] <= 4.5
    for bad in (5.0, 4000.0):
        with pytest.raises(ValueError, match=r"FEDHISTO_SUPERNODE_HEARTBEAT_S=.*accepts heartbeat intervals in \[10"):
            set_heartbeat(bad)
