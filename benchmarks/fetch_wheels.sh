#!/usr/bin/env bash
# The wheels gpu_check.sh installs on the GPU machine (Python 3.12, x86-64), into benchmarks/wheels
# (git-ignored; name it in the device tool's carry). Versions as pinned by this checkout's venv.
# typing-extensions too: pydantic 2.14 needs >= 4.16, and the device image's version is not known
# (installed under --target it comes first on PYTHONPATH; newer releases keep the older API).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$here/wheels" \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
ls -l "$here/wheels"
