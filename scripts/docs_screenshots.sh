#!/usr/bin/env bash
# Build the documentation site, serve it on 127.0.0.1 and have headless Chromium render the home page
# and one strategy page (ZeRO) to PNG, to look at: does the theme load, the nav show, markdown render?
#   bash scripts/docs_screenshots.sh [OUT_DIR]      (default /tmp/unison-docs-screenshots)
# Needs the docs extra (pip install -e '.[docs]'); installs Chromium with apt-get when it is missing.
# Not run in CI: tests/test_docs_site.py checks the build itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${1:-/tmp/unison-docs-screenshots}"
mkdir -p "$OUT"
SITE="$(mktemp -d)"
SERVER=""
cleanup() {
  [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null || true
  rm -rf "$SITE"
}
trap cleanup EXIT

CHROMIUM="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$CHROMIUM" ]; then
  echo "[screenshots] chromium not found: installing it with apt-get"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  CHROMIUM="$(command -v chromium)"
fi

NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --quiet --site-dir "$SITE"

# a free port: bind port 0, read what the kernel chose, release it for the server
PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$PY" -m http.server "$PORT" --bind 127.0.0.1 --directory "$SITE" >/dev/null 2>&1 &
SERVER=$!
for _ in $(seq 50); do
  "$PY" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/')" 2>/dev/null && break
  sleep 0.1
done

for page in "home:" "zero:zero/"; do
  name="${page%%:*}"
  # --no-sandbox: Chromium refuses to start its sandbox as root (containers, CI)
  "$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1600 \
    --screenshot="$OUT/$name.png" "http://127.0.0.1:$PORT/${page#*:}" 2>/dev/null
  echo "[screenshots] $OUT/$name.png"
done
