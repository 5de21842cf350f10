#!/usr/bin/env bash
# The SHA-256 of every prediction file of a finished run, and one digest of the sorted list: two runs whose
# digests match made byte-identical predictions (how a code move or a new host is checked to change no
# prediction; docs/changelog.md records such checks).
# Usage: benchmarks/predictions_digest.sh [RESULTS_DIR]   (default: results)
set -euo pipefail
results="${1:-results}"
[ -d "$results/predictions" ] || { echo "no $results/predictions: run the pipeline first" >&2; exit 2; }
list=$(cd "$results/.." && find "$(basename "$results")/predictions" -name '*.csv' | LC_ALL=C sort | xargs sha256sum)
echo "$list"
echo "files: $(echo "$list" | wc -l)"
echo "digest of the list: $(echo "$list" | sha256sum | cut -d' ' -f1)"
