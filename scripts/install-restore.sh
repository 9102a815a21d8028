#!/bin/sh
# Install kiln *without torch* into the given Python: the Docker `restore` target runs exactly
# this, and tests/test_packaging.py runs it with a freshly built wheel into a fresh venv.
# Usage: scripts/install-restore.sh PYTHON [SOURCE]
#   SOURCE: a source folder, a built wheel or sdist, or a requirement such as torch-kiln==0.1.0
#           (default: the checkout this script lives in).
#   KILN_EXTRAS="s3,oci": storage extras to add (plain files and http(s) need none).
# pip cannot leave one dependency out, so kiln goes in with --no-deps and its other dependencies,
# read from what was just installed (scripts/deps.py --installed), follow.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${1:-python3}
SRC=${2:-$HERE/..}
"$PY" -m pip install --no-cache-dir --quiet --no-deps "$SRC"
REQS=$(mktemp)
trap 'rm -f "$REQS"' EXIT
"$PY" "$HERE/deps.py" --installed torch-kiln --without torch,triton --extras "${KILN_EXTRAS:-}" >"$REQS"
# --no-warn-conflicts: pip would report "torch-kiln requires torch, which is not installed",
# which is this install's whole point. Commands that need torch say so when run (exit 2).
"$PY" -m pip install --no-cache-dir --quiet --no-warn-conflicts -r "$REQS"
# The restore path must work, and torch must not be there to lean on.
if "$PY" -c "import torch" 2>/dev/null; then echo "torch is importable in the restore install" >&2; exit 1; fi
"$PY" -m kiln --version
