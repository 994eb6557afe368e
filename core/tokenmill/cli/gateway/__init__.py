"""``tokenmill gateway-config``: a whole nginx or Envoy config that serves several models from one
address, routing each request by its ``x-model`` header to that model's tokenmill (or TGI) instances.

    tokenmill gateway-config --format nginx|envoy --listen HOST:PORT \\
        --model NAME=URL[,timeout=SECONDS][,max-connections=N] ...

A name given twice adds an instance to that model (its options are the first mention's). The
gateway answers ``GET /`` without ``x-model`` itself (its own health check), a missing or unknown
``x-model`` with TGI's JSON error (404) naming the known models, an instance that is down with a
JSON 502, and a model at its connection limit with a JSON 429, as tokenmill says when it is full.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tokenmill.cli.gateway import envoy, nginx
from tokenmill.cli.gateway.spec import (
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT_S,
    Gateway,
    GatewayConfigError,
    parse_listen,
    parse_models,
)

__all__ = ["Gateway", "GatewayConfigError", "gateway_config", "parse_listen", "parse_models", "render"]


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(prog="tokenmill gateway-config", description=__doc__.split("\n\n")[0],
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    found.add_argument("--format", choices=("nginx", "envoy"), required=True)
    found.add_argument("--listen", default="0.0.0.0:8080", help="HOST:PORT the gateway listens on (0.0.0.0:8080)")
    found.add_argument("--model", action="append", default=[],
                       metavar="NAME=URL[,timeout=S][,max-connections=N][,max-body=BYTES]",
                       help=f"a model and one instance of it (repeat; timeout {DEFAULT_TIMEOUT_S} s, "
                            f"max-connections {DEFAULT_MAX_CONNECTIONS} and max-body {DEFAULT_MAX_BODY} "
                            "(the servers' --payload-limit) unless given)")
    return found


def render(gateway: Gateway, kind: str) -> str:
    return nginx.render(gateway) if kind == "nginx" else envoy.render(gateway)


def gateway_config(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    try:
        host, port = parse_listen(args.listen)
        gateway = Gateway(host, port, parse_models(args.model))
    except GatewayConfigError as error:
        print(f"tokenmill gateway-config: error: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(render(gateway, args.format))
    return 0
