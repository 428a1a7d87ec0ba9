#!/usr/bin/env bash
# Set everything up (idempotent; fast when already done), then run the pipeline on the embedded defaults.
# Arguments are passed to `python -m builder run`, e.g. scripts/run.sh --set mine.max_topics=8
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
cd "$repo"
exec "${BUILDER_VENV:-$repo/.venv}/bin/python" -m builder run "$@"
