#!/usr/bin/env bash
# The accelerator run in one command, bounded to 8 minutes: tools/gpu_check.sh OUT_DIR [--device cpu]
# (see docs/gpu.md and tools/gpu_check.py). $PYTHON picks the interpreter (default python3).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ]; then
    echo "usage: tools/gpu_check.sh OUT_DIR [--device cuda|cpu]   (docs/gpu.md)" >&2
    exit 2
fi
py="${PYTHON:-python3}"
exec "$py" "$here/gpu_check.py" --python "$py" "$@"
