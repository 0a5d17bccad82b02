#!/usr/bin/env bash
# Browser + demo dependencies for tests/test_demo.py and tests/test_demo_browser.py. Idempotent; runs as root in CI.
#   - Debian's chromium (the browser the test drives through executable_path=/usr/bin/chromium)
#   - the playwright Python package only: NO `playwright install` (it downloads a browser and fails offline)
#   - gradio + gradio_client (the `demo` extra), without the project itself: torch is installed later by .ci/run
# Run inside the virtual environment the tests use.
set -euo pipefail

if ! command -v chromium >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq || true   # a stale index is fine if the package is already known
  $SUDO apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
fi
chromium --version

PY="${PYTHON:-python}"
"$PY" - <<'EOF' || "$PY" -m pip install -q "gradio>=5,<7" "gradio_client" "playwright>=1.40"
import importlib.util, sys
missing = [m for m in ("gradio", "gradio_client", "playwright") if importlib.util.find_spec(m) is None]
sys.exit(1 if missing else 0)
EOF
"$PY" -c "import gradio, playwright; from importlib.metadata import version as v; \
print('gradio', gradio.__version__, '| playwright', v('playwright'))"
