#!/usr/bin/env bash
# Set everything up (idempotent; fast when already done), then run the full test suite, integration tests
# against the real vLLM server included. Arguments are passed to pytest, e.g. scripts/test.sh -k store
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh"
cd "$repo"
exec "${BUILDER_VENV:-$repo/.venv}/bin/python" -m pytest "$@"
