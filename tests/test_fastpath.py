"""The fast path (``federation.fastpath``): refused by name on a Flower it is not tested against, never
imported by the protocol or the stock apps, its Flower app the stock one but for the ServerApp; on a
tested Flower, its object pulls retry after 0.05 s (doubling to 0.5 s) instead of 1 s, bounded by
Flower's total time, with Flower's objects and errors, and its SuperNode's heartbeat is settable."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from flower_support import needs_fastpath

pytestmark = pytest.mark.flower
PROTOCOL = ("server", "site", "handlers", "records", "server_app", "client_app")


def test_the_fast_path_names_the_flower_it_is_tested_against_and_refuses_any_other():
    from fedhisto.federation.fastpath import TESTED_FLWR, FastpathUnsupported, require, supported

    assert TESTED_FLWR == ("1.42",)
    assert supported("1.42.0") and supported("1.42.7")
    assert not supported("1.41.0") and not supported("1.43.0") and not supported("2.42.0") and not supported("")
    require("1.42.3")
    with pytest.raises(FastpathUnsupported, match=r"modifies Flower's process model and is tested against flwr "
                                                  r"1\.42\.x only; this environment has flwr 1\.41\.0\. Run without "
                                                  r"--fastpath"):
        require("1.41.0")
    with pytest.raises(FastpathUnsupported, match=r'pip install "flwr>=1\.42,<1\.43"'):
        require("1.43.0")


def test_no_protocol_module_or_stock_app_imports_the_fast_path():
    """By their text (no mention at all) and by what importing them loads."""
    import fedhisto.federation as federation

    root = Path(federation.__file__).parent
    for name in PROTOCOL:
        text = (root / f"{name}.py").read_text()
        assert not [w for w in ("fastpath", "fast_pull", "supernode_poll") if w in text], name
    stock = tomllib.loads((root / "app/pyproject.toml").read_text())["tool"]["flwr"]["app"]["components"]
    assert stock == {"serverapp": "fedhisto.federation.server_app:app",
                     "clientapp": "fedhisto.federation.client_app:app"}
    code = ("import json, sys\n" + "".join(f"import fedhisto.federation.{n}\n" for n in PROTOCOL)
            + "print(json.dumps(sorted(m for m in sys.modules if 'fastpath' in m)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_fast_path_app_is_the_stock_app_but_for_its_server_app():
    from fedhisto.federation import APP_DIR
    from fedhisto.federation.fastpath import APP_DIR as FAST_APP_DIR

    stock, fast = (tomllib.loads((d / "pyproject.toml").read_text()) for d in (APP_DIR, FAST_APP_DIR))
    assert fast["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "fedhisto.federation.fastpath.patched_server_app:app", "clientapp": "fedhisto.federation.client_app:app"}
    assert fast["tool"]["flwr"]["app"]["config"] == stock["tool"]["flwr"]["app"]["config"]
    assert fast["project"]["dependencies"] == stock["project"]["dependencies"]


def test_fedhisto_federate_fastpath_runs_the_fast_path_app_or_refuses_the_flower(tmp_path: Path, monkeypatch,
                                                                                 capsys):
    import fedhisto.cli as cli
    from fedhisto.federation import APP_DIR
    from fedhisto.federation.fastpath import APP_DIR as FAST_APP_DIR
    from fedhisto.federation.fastpath import supported

    ran = []
    monkeypatch.setattr(cli, "_exec", lambda cmd, env=None: ran.append(cmd) or 0)
    base = ["federate", "--insecure", "--superlink", "127.0.0.1:9093", "--dataset-identity", "x",
            "--flwr-home", str(tmp_path / "home"), "--out", str(tmp_path / "out")]
    assert cli.main(base) == 0 and ran[-1][2] == str(APP_DIR)
    with pytest.raises(ValueError, match="Simulation Engine"):
        cli.main([*base, "--fastpath", "--simulation"])
    if supported():
        assert cli.main([*base, "--fastpath"]) == 0 and ran[-1][2] == str(FAST_APP_DIR)
    else:  # refused before anything runs, with the reason
        capsys.readouterr()
        assert cli.main([*base, "--fastpath"]) == 2 and len(ran) == 1
        assert "is tested against flwr 1.42.x only" in capsys.readouterr().err


@needs_fastpath
def test_the_fast_path_server_app_shortens_the_grid_pulls_and_serves_the_stock_app(monkeypatch):
    import importlib

    import flwr.supercore.inflatable.inflatable_utils as iu
    import flwr.superlink.grid.http_grid as http_grid

    monkeypatch.setattr(iu, "pull_objects", iu.pull_objects)
    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)
    monkeypatch.delitem(sys.modules, "fedhisto.federation.fastpath.patched_server_app", raising=False)
    fast = importlib.import_module("fedhisto.federation.fastpath.patched_server_app")
    from fedhisto.federation.server_app import app

    assert fast.app is app
    assert http_grid.pull_objects is iu.pull_objects and hasattr(http_grid.pull_objects, "flower_pull_objects")


@pytest.fixture
def flower_modules(monkeypatch):
    import flwr.supercore.inflatable.inflatable_utils as iu
    import flwr.supernode.start_client_internal as sic

    # restored after the test: patch() rebinds these names
    monkeypatch.setattr(iu, "pull_objects", iu.pull_objects)
    monkeypatch.setattr(sic, "pull_objects", sic.pull_objects)
    return iu, sic


@needs_fastpath
def test_pulls_retry_sooner_and_keep_flowers_objects_and_errors(flower_modules, monkeypatch):
    iu, sic = flower_modules
    from fedhisto.federation.fastpath.fast_pull import patch

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


@needs_fastpath
def test_a_module_without_flowers_pull_objects_is_refused(flower_modules):
    from fedhisto.federation.fastpath.fast_pull import patch

    with pytest.raises(RuntimeError, match="no pull_objects"):
        patch(("json",))


@needs_fastpath
def test_the_supernode_heartbeat_interval_is_set_where_flower_reads_it_and_refused_out_of_range(monkeypatch):
    """What the SuperNode announces (the SuperLink's offline deadline is twice it) and what its sender waits
    between heartbeats are both Flower's module constant, read at call time."""
    import flwr.supercore.heartbeat as sender
    import flwr.supernode.fleet_http_connection as connection

    from fedhisto.federation.fastpath.supernode_poll import set_heartbeat

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
