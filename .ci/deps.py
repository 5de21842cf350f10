"""Print the package's dependencies and those of the named extras, one requirement a line (pyproject.toml).

CI installs them into a proof's venv while the test command's venv is still installing, so that only the
editable install of the package itself waits for it (two `pip install -e` of one tree at once would race
on src/fedhisto.egg-info): `pip install -r <(python3 .ci/deps.py federation test)`.
"""

import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
extras = project.get("optional-dependencies", {})
unknown = [e for e in sys.argv[1:] if e not in extras]
if unknown:
    sys.exit(f"pyproject.toml declares no extra {unknown[0]!r} (known: {', '.join(sorted(extras))})")
print("\n".join([*project["dependencies"], *(r for e in sys.argv[1:] for r in extras[e])]))
