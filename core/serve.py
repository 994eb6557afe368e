"""Running the ASGI app: gunicorn with one uvicorn worker (production) or uvicorn alone."""

from __future__ import annotations

from typing import Any

from tokenmill.config import Config
from tokenmill.logs import gunicorn_logconfig
from tokenmill.server import create_app


def serve(config: Config) -> int:
    if config.server == "uvicorn":
        import uvicorn

        uvicorn.run(create_app(config), host=config.hostname, port=config.port, log_config=None,
                    timeout_graceful_shutdown=30)
        return 0
    return _serve_gunicorn(config)


def _serve_gunicorn(config: Config) -> int:
    from gunicorn.app.base import BaseApplication

    class TokenmillApplication(BaseApplication):  # type: ignore[misc]
        def load_config(self) -> None:
            options: dict[str, Any] = {
                "bind": f"[{config.hostname}]:{config.port}" if ":" in config.hostname else f"{config.hostname}:{config.port}",
                "workers": 1,  # one process owns the model
                "worker_class": "uvicorn_worker.UvicornWorker",
                "timeout": 0,  # model loading and long generations are not hangs
                "graceful_timeout": 30,
                "accesslog": None,
                "loglevel": "info",
                "logconfig_dict": gunicorn_logconfig(config.json_output),
            }
            for key, value in options.items():
                self.cfg.set(key, value)

        def load(self) -> Any:
            # Built in the worker after the fork; the engine thread starts at lifespan start-up.
            return create_app(config)

    TokenmillApplication().run()
    return 0
