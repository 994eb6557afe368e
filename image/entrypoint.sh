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
exec gunicorn --config "$here/gunicorn.conf.py"
