#!/usr/bin/env bash
# Set up (first run only), then the whole test suite. Extra arguments go to pytest.
#   scripts/test.sh          everything (~12 min on this 2-core VM): unit, integration (Ray
#                            actors, servers), e2e (bench smoke runs, chaos, `ray up` smoke),
#                            SmolLM2 checks
#   scripts/test.sh --fast   the inner loop (~2 min): no Ray actors or servers, no e2e runs,
#                            no SmolLM2 checks
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [ "${1:-}" = "--fast" ]; then
  shift
  exec python -m pytest -q -m "not integration and not e2e and not cluster and not realmodel" "$@"
fi
exec python -m pytest -q "$@"
