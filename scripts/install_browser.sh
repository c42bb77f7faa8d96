#!/usr/bin/env bash
# Set-up for the /ui browser test (tests/serving/test_ui.py): Debian's chromium and its
# chromedriver (apt), and selenium (PyPI) into the venv that runs the tests. Never downloads
# a browser from anywhere else. Idempotent: does nothing when everything is present.
# Usage: scripts/install_browser.sh [PYTHON]   (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
      echo "install_browser.sh: need root (or sudo) to apt-get install chromium chromium-driver" >&2
      exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver
fi

if ! "$PY" -c "import selenium" >/dev/null 2>&1; then
  "$PY" -m pip install -q "selenium>=4.20"
fi
/usr/bin/chromium --version
/usr/bin/chromedriver --version
"$PY" -c "import selenium; print('selenium', selenium.__version__)"
