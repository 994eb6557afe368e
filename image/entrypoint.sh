#!/bin/sh
# Container entrypoint: every flag also comes from its environment variable
# (MODEL_ID, MAX_TOTAL_TOKENS, ...), and PORT is honoured as serverless platforms set it.
# exec, so that SIGTERM from the platform reaches the server directly.
set -e
exec tokenmill launch "$@"
