"""What a gateway config is made of: the gateway's address, its models and their instances, parsed
from ``tokenmill gateway-config``'s flags, and the JSON bodies of its own answers."""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

DEFAULT_TIMEOUT_S = 600
"""A generation's whole time may be minutes (long outputs, a queue); TGI's clients wait that long too."""
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_BODY = 2_000_000
"""tokenmill's own --payload-limit: a larger body is refused at the gateway, before it is read."""
BODY_TIMEOUT_S = 30
"""tokenmill's --body-read-timeout: a client's headers, and its body, must arrive within it (nginx: 408)."""
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
"""What a model's name may be: it becomes part of an nginx upstream and an Envoy cluster name."""
LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){LABEL}(\.{LABEL})*$")
"""A DNS name (RFC 1123): the only hosts, besides IP addresses, written into a config."""


def is_host(text: str) -> bool:
    """Whether ``text`` is an IP address or a DNS name: nothing else reaches the config (a host such as
    ``127.0.0.1;include evil.conf`` would become nginx directives)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(HOSTNAME.match(text))


class GatewayConfigError(ValueError):
    """A ``--model`` or ``--listen`` that cannot make a config; the message says which and why."""


@dataclass(frozen=True)
class Instance:
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass
class Model:
    """One model behind the gateway: the ``x-model`` value that selects it and where it runs."""

    name: str
    instances: list[Instance] = field(default_factory=list)
    timeout_s: int = DEFAULT_TIMEOUT_S
    """How long a request may wait for its response's next bytes (a stream's next event)."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    """Requests in flight to this model, over all its instances, before the gateway answers 429."""
    max_body: int = DEFAULT_MAX_BODY
    """The largest request body the gateway takes for this model (its servers' --payload-limit)."""

    @property
    def upstream(self) -> str:
        """Its name in the gateway's config (an nginx upstream, an Envoy cluster)."""
        return "model_" + re.sub(r"[^A-Za-z0-9_]", "_", self.name)


@dataclass(frozen=True)
class Gateway:
    host: str
    port: int
    models: list[Model]

    @property
    def names(self) -> list[str]:
        return [model.name for model in self.models]


def parse_listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    if not port.isdigit() or not 0 < int(port) < 65536 or not is_host(host):
        raise GatewayConfigError(f"--listen {text!r}: expected HOST:PORT (an IP address or a DNS name), "
                                 "e.g. 0.0.0.0:8080")
    return host, int(port)


def parse_instance(name: str, url: str) -> Instance:
    parts = urlsplit(url if "://" in url else "http://" + url)
    if (parts.scheme != "http" or not parts.hostname or not is_host(parts.hostname) or parts.username is not None
            or parts.path not in ("", "/") or parts.query or parts.fragment or "#" in url):
        raise GatewayConfigError(f"--model {name}={url}: the URL must be http://HOST:PORT (the instance's root)")
    try:
        port = parts.port or 80
    except ValueError as error:
        raise GatewayConfigError(f"--model {name}={url}: {error}") from error
    return Instance(parts.hostname, port)


def parse_models(specs: Sequence[str]) -> list[Model]:
    """The models of ``--model NAME=URL[,timeout=SECONDS][,max-connections=N][,max-body=BYTES]`` arguments,
    in order."""
    models: dict[str, Model] = {}
    for spec in specs:
        name, equals, rest = spec.partition("=")
        if not equals or not rest:
            raise GatewayConfigError(f"--model {spec!r}: expected NAME=URL[,timeout=SECONDS][,max-connections=N]"
                                     "[,max-body=BYTES]")
        if not NAME.match(name):
            raise GatewayConfigError(f"--model {spec!r}: a model name is letters, digits, '.', '_' and '-' "
                                     "(at most 63), starting with a letter or digit")
        url, *options = rest.split(",")
        model = models.get(name)
        if model is None:
            model = models[name] = Model(name)
            for option in options:
                apply_option(model, spec, option)
        elif options:
            raise GatewayConfigError(f"--model {spec!r}: {name}'s options go on its first --model only")
        model.instances.append(parse_instance(name, url))
    if not models:
        raise GatewayConfigError("give at least one --model NAME=URL")
    taken: dict[str, str] = {}
    for model in models.values():
        if model.upstream in taken:
            raise GatewayConfigError(f"models {taken[model.upstream]!r} and {model.name!r} would share the "
                                     f"config name {model.upstream}: rename one")
        taken[model.upstream] = model.name
    return list(models.values())


def apply_option(model: Model, spec: str, option: str) -> None:
    key, _, value = option.partition("=")
    if not value.isdigit() or int(value) < 1:
        raise GatewayConfigError(f"--model {spec!r}: {key} takes a whole number of at least 1, not {value!r}")
    if key == "timeout":
        model.timeout_s = int(value)
    elif key == "max-connections":
        model.max_connections = int(value)
    elif key == "max-body":
        model.max_body = int(value)
    else:
        raise GatewayConfigError(f"--model {spec!r}: unknown option {key!r} (timeout, max-connections, max-body)")


def error_body(message: str, error_type: str) -> str:
    """TGI's error JSON."""
    return json.dumps({"error": message, "error_type": error_type})


def missing_model_body(gateway: Gateway) -> str:
    return error_body("no x-model header: set it to one of the models this gateway serves: "
                      + ", ".join(gateway.names), "not_found")


def unknown_model_body(gateway: Gateway) -> str:
    # The header's value is not echoed: neither gateway can escape it into JSON.
    return error_body("unknown model in the x-model header: this gateway serves " + ", ".join(gateway.names),
                      "not_found")


def unavailable_body(model: str | None = None) -> str:
    which = f"model {model}" if model else "the model"
    return error_body(f"no instance of {which} answered: it is down, starting or unreachable; retry later",
                      "unavailable")


def too_large_body() -> str:
    return error_body("the request body is larger than this gateway takes for the model (its max-body)",
                      "validation")


def overloaded_body(model: str | None = None) -> str:
    which = f"model {model}" if model else "the model"
    return error_body(f"{which} has as many requests in flight as this gateway allows; retry later",
                      "overloaded")


def status_body(gateway: Gateway) -> str:
    """The gateway's own answer to ``GET /`` without ``x-model``."""
    return json.dumps({"status": "ok", "models": gateway.names})


