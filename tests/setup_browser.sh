#!/usr/bin/env bash
# Installs what the report and plot tests need and the build does not: Chromium (Debian's
# package) for the headless rendering. gnuplot comes with scripts/setup.sh, since `make demo`
# draws its report with it. As root it runs apt-get; otherwise it prints the command and fails.
command -v chromium >/dev/null && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "setup_browser: please run: sudo apt-get install -y --no-install-recommends chromium" >&2
    exit 1
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 ||
    { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; }
command -v chromium >/dev/null || { echo "setup_browser: apt-get could not install chromium" >&2; exit 1; }
