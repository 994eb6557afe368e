"""The ``tokenmill`` command: ``launch`` serves a model, ``plugins`` lists what is installed."""

from __future__ import annotations

import sys
from typing import Sequence

from tokenmill import __version__
from tokenmill.config import Config, ConfigError, parse_config
from tokenmill.loading import ModelLoadError, resolve
from tokenmill.logs import setup_logging
from tokenmill.plugins import PluginError, build_plugin_manager, choose_all, list_all


def preflight(config: Config) -> None:
    """Fail before serving on what can be known without loading: plugin choices, model path."""
    choose_all(build_plugin_manager(), config.backend, config.attention, config.kv_allocator, config.scheduler,
               config.block_size)
    resolve(config.model_id, config.revision)


def launch(argv: Sequence[str]) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as error:
        print(f"tokenmill: error: {error}", file=sys.stderr)
        return 2
    setup_logging(config.json_output)
    try:
        preflight(config)
    except (ConfigError, PluginError, ModelLoadError) as error:
        print(f"tokenmill: error: {error}", file=sys.stderr)
        return 2
    from tokenmill.serve import serve

    return serve(config)


def plugins(argv: Sequence[str]) -> int:
    pm = build_plugin_manager()
    rows = list_all(pm)
    width = max((len(r.name) for r in rows), default=4)
    print(f"{'kind':<13} {'name':<{width}}  {'status':<40} source")
    for row in rows:
        status = "available" if row.unavailable_reason is None else f"unavailable: {row.unavailable_reason}"
        print(f"{row.kind:<13} {row.name:<{width}}  {status:<40} {row.source}")
    return 0


USAGE = """usage: tokenmill {launch,plugins,version} [options]

  launch   serve a model over TGI's HTTP API (tokenmill launch --help)
  plugins  list the registered backends, attention kernels, schedulers and KV allocators
  version  print the version
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "launch":
        return launch(rest)
    if command == "plugins":
        return plugins(rest)
    if command in ("version", "--version"):
        print(__version__)
        return 0
    print(f"tokenmill: error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
