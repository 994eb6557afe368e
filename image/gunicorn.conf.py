# gunicorn's configuration in the container: every setting comes from tokenmill's own configuration
# (environment variables, and the container's flags that image/entrypoint.sh passes in
# TOKENMILL_ARGS), through the same functions `tokenmill launch` uses, so the two cannot drift apart.
import sys

from tokenmill.cli.launch import PREFLIGHT_ERRORS, preflight
from tokenmill.http.serve import config_from_environment, gunicorn_options

try:
    _config = config_from_environment()
    preflight(_config)  # a bad setting stops here with one line, before gunicorn starts a worker
except PREFLIGHT_ERRORS as error:
    print(f"tokenmill: error: {error}", file=sys.stderr)
    sys.exit(2)

globals().update(gunicorn_options(_config))
wsgi_app = "tokenmill.http.serve:app_from_environment()"
