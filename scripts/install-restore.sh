#!/bin/sh
# Install kiln *without torch* into the given Python (the Docker `restore` stage runs exactly this,
# and tests/test_docker.py runs it into a fresh venv). Extras: KILN_EXTRAS="s3,oci" for example.
# Usage: scripts/install-restore.sh PYTHON SOURCE_DIR
set -eu
PY=${1:-python3}
SRC=${2:-.}
"$PY" -m pip install --no-cache-dir --quiet --no-deps "$SRC"
"$PY" "$SRC/scripts/deps.py" --without torch,triton --extras "${KILN_EXTRAS:-}" > /tmp/kiln-restore-requirements.txt
"$PY" -m pip install --no-cache-dir --quiet -r /tmp/kiln-restore-requirements.txt
rm -f /tmp/kiln-restore-requirements.txt
# The restore path must work, and torch must not be there to lean on.
if "$PY" -c "import torch" 2>/dev/null; then echo "torch is importable in the restore install" >&2; exit 1; fi
"$PY" -m kiln --version
