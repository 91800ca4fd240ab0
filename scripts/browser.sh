#!/usr/bin/env bash
# Install the headless browser the chat page's tests drive (tests/e2e/test_chat_page.py):
# Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver), with a font.
# A no-op when both are there; where they cannot be installed (not root, no apt-get) it says so
# and exits 0, and those tests skip naming the reason. ./test.sh runs it.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "scripts/browser.sh: no chromium and no way to install it here (needs root and apt-get):" \
       "the chat page's browser tests will skip" >&2
  exit 0
fi
echo "scripts/browser.sh: installing chromium and chromium-driver (about 30 s)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core; } >&2; then
  echo "scripts/browser.sh: apt-get could not install chromium: the chat page's browser tests will skip" >&2
fi
