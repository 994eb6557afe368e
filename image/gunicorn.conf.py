# gunicorn's configuration in the container: every setting comes from tokenmill's own configuration
# (environment variables, and the container's flags that image/entrypoint.sh passes in
# TOKENMILL_ARGS), through the same function `tokenmill launch` uses, so the two cannot drift apart.
import sys

from tokenmill.config import ConfigError
from tokenmill.serve import config_from_environment, gunicorn_options

try:
    _config = config_from_environment()
except ConfigError as error:
    print(f"tokenmill: error: {error}", file=sys.stderr)
    sys.exit(2)

globals().update(gunicorn_options(_config))
wsgi_app = "tokenmill.serve:app_from_environment()"
