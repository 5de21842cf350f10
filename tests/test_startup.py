"""Start-up cut (issue 22, item 1): a stage imports only what it uses. Every job is a fresh process, so an
unused import (scikit-learn, matplotlib, the experiments package) is paid once per job, 54+ times per run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

UNUSED = ("sklearn", "matplotlib", "fedhisto.experiments")
# training, prediction, the bootstrap and the SuperNode side (site.py imports no flwr)
LEAN = ("fedhisto.predict.stage", "fedhisto.train.stage", "fedhisto.bootstrap.stage", "fedhisto.federation.site")


def _unused_imports(modules: tuple[str, ...]) -> dict[str, list[str]]:
    # one process for all (each costs seconds of torch/peft start-up); a culprit is named per module
    code = ("import importlib, json, sys\nfound = {}\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            f"    found[name] = [m for m in {UNUSED!r} if m in sys.modules]\n"
            "print(json.dumps(found))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_training_prediction_bootstrap_and_the_site_import_no_unused_heavy_package():
    found = _unused_imports(LEAN)
    assert found == {name: [] for name in LEAN}, f"unused packages imported (first module to show them): {found}"


@pytest.mark.flower
def test_the_flower_client_app_imports_no_unused_heavy_package():
    # the README's first test command installs no flwr, so this runs in the Flower lane
    pytest.importorskip("flwr")
    name = "fedhisto.federation.client_app"
    assert _unused_imports((name,)) == {name: []}


@pytest.mark.flower
def test_the_per_message_processes_import_neither_torch_nor_what_they_do_not_use():
    """Flower starts one process per message at every site: the ClientApp module imports no torch and no
    model code at load (the handler brings them when a message arrives), and the fast path's launcher
    the SuperExec starts imports no Flower."""
    pytest.importorskip("flwr")
    code = ("import json, sys\nimport fedhisto.federation.fastpath.clientapp_launcher\n"
            "launcher = sorted(m for m in ('flwr', 'torch', 'numpy') if m in sys.modules)\n"
            "import fedhisto.federation.client_app\n"
            "app = sorted(m for m in ('torch', 'peft', 'transformers', 'sklearn', 'fedhisto.model') if m in sys.modules)\n"
            "print(json.dumps([launcher, app]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [[], []]
