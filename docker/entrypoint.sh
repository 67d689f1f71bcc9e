#!/bin/sh
# Entrypoint of the agentrl images: optionally wait until some HTTP health URLs answer 200, then run the
# command (agentrl gateway / agentrl train / torchrun -m trainer / agentrl agent ...).
#
#   WAIT_FOR_URLS="http://gateway:8000/health http://sglang:30000/health"   (space separated; optional)
#   WAIT_TIMEOUT_S=600                                                       (give up after this long)
#
# Compose's depends_on: condition: service_healthy already orders start-up; the wait covers a restart
# of a dependency and runs without Compose (docker run, Kubernetes).
set -eu

if [ -n "${WAIT_FOR_URLS:-}" ]; then
    python - <<'PY' || exit 1
import os, sys, time, urllib.error, urllib.request
urls = os.environ["WAIT_FOR_URLS"].split()
deadline = time.monotonic() + float(os.environ.get("WAIT_TIMEOUT_S", "600"))
for url in urls:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    print(f"entrypoint: {url} is up", flush=True)
                    break
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            print(f"entrypoint: {url} not healthy after {os.environ.get('WAIT_TIMEOUT_S', '600')} s", file=sys.stderr)
            sys.exit(1)
        time.sleep(2)
PY
fi

exec "$@"
