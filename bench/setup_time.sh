#!/usr/bin/env bash
# Times README's set-up + main-job command as a new user runs it: a fresh clone of this repository's HEAD,
# an empty pip cache, the command copied from README's "Quick start" and run as written. Prints each step's
# start time (bash -x with timestamps), the total, and the load average before and after (timings on a
# loaded machine are not comparable: note the load next to any number).
#
# Usage: bash bench/setup_time.sh [WORKDIR]     (default: a new temp folder, removed at the end)
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${1:-$(mktemp -d)}
[[ $# -ge 1 ]] || trap 'rm -rf "$WORK"' EXIT
COMMAND=$(awk '/^## Quick start/{q=1} q && /^```bash/{getline; print; exit}' "$REPO/README.md")
[[ -n "$COMMAND" ]] || { echo "no set-up command found in README's Quick start" >&2; exit 1; }
git clone -q "$REPO" "$WORK/clone"
echo "command: $COMMAND"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
SECONDS=0
(cd "$WORK/clone" && PIP_CACHE_DIR="$WORK/pip-cache" bash -c "PS4='+ [\$(date +%T)] '; set -x; $COMMAND")
took=$SECONDS
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "README set-up + main job: $took s (fresh clone, empty pip cache)"
