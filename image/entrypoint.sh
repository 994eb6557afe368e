#!/bin/sh
# Container entrypoint. Configuration comes from environment variables, one per flag
# (MODEL_ID, MAX_TOTAL_TOKENS, API_KEY, ...; PORT as serverless platforms set it), and from
# flags given to the container (`docker run IMAGE --max-batch-size 8`), which override them.
# The flags travel to gunicorn's worker as a JSON list in TOKENMILL_ARGS; gunicorn reads its own
# settings from gunicorn.conf.py beside this script. `exec`, so that the platform's SIGTERM
# reaches gunicorn, which drains the worker (see tokenmill/serve.py).
set -e
here=$(dirname "$(readlink -f "$0")")
if [ "${1:-}" = "tokenmill" ]; then  # any other tokenmill command: `docker run IMAGE tokenmill plugins`
    exec "$@"
fi
TOKENMILL_ARGS=$(python -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@")
export TOKENMILL_ARGS
# Serve with python-bind (the interpreter with cap_net_bind_service, see the Dockerfile), which binds
# PORT=80 as this non-root user, when it really holds that capability here. It does not where the
# container's capabilities leave it out (docker run --cap-drop ALL, Kubernetes' drop: ["ALL"]: the kernel
# refuses to start the file at all) or where no_new_privs withholds file capabilities (--security-opt
# no-new-privileges, allowPrivilegeEscalation: false); plain python serves then: on a port >= 1024, or
# on any port where the runtime sets net.ipv4.ip_unprivileged_port_start=0 (Docker since 20.10, Podman,
# containerd 2). CAP_NET_BIND_SERVICE is bit 10 of CapEff. See image/README.md.
python="python"
if command -v python-bind >/dev/null 2>&1 && python-bind -c 'import sys
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
sys.exit(0 if int(status["CapEff"], 16) >> 10 & 1 else 1)' 2>/dev/null; then
    python="python-bind"
fi
exec "$python" -m gunicorn --config "$here/gunicorn.conf.py"
