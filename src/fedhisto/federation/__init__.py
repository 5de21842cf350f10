"""Real federation on Flower (``pip install -e ".[federation]"``): a ServerApp whose rounds call the
methods' server hooks, a ClientApp that runs their client hooks on a site's own data, and the
process management (TLS certificates, SuperNode keys, SuperLink/SuperNodes) the CLI and tests use.

Nothing here is imported by the core package: ``import fedhisto`` works without flwr. The Flower app
directory handed to ``flwr run`` is :data:`APP_DIR` (its pyproject names the components and the
run-config defaults). See docs/federation.md.
"""

from __future__ import annotations

from pathlib import Path

APP_DIR = Path(__file__).resolve().parent / "app"
