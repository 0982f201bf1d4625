#!/usr/bin/env bash
# Installs nats-server (Debian's package) for the replica tests, unless one is already there.
# The tests find it as $KVGATE_NATS_SERVER, on PATH, or at Debian's /usr/sbin/nats-server.
set -euo pipefail
if [ -n "${KVGATE_NATS_SERVER:-}" ] && [ -x "$KVGATE_NATS_SERVER" ]; then exit 0; fi
if command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ]; then exit 0; fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-nats.sh: nats-server is missing and apt-get is not available; install NATS server 2.x and set KVGATE_NATS_SERVER" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
echo "installing nats-server from Debian's packages"
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q nats-server >/dev/null 2>&1 || {
  DEBIAN_FRONTEND=noninteractive $sudo apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q nats-server >/dev/null
}
# Debian's package also enables a system service; the tests start their own servers on free ports.
$sudo systemctl disable --now nats-server >/dev/null 2>&1 || true
{ command -v nats-server || ls /usr/sbin/nats-server; } >/dev/null
