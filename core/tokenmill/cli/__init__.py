"""The ``tokenmill`` command: ``launch`` serves a model, ``plugins`` lists what is installed,
``watermark-detect`` tests text for the green-list watermark, ``gateway-config`` writes a gateway's
config for several models. Each command lives in its own module (:mod:`.launch`, :mod:`.plugins`,
:mod:`.watermark`, :mod:`.gateway`); :func:`main` imports the one it runs, so that a command that needs
no model (``gateway-config``, ``version``) does not pay for importing torch."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tokenmill import __version__
from tokenmill.model import collector

__all__ = ["USAGE", "main"]

USAGE = """usage: tokenmill {launch,plugins,watermark-detect,gateway-config,version} [options]

  launch            serve a model over TGI's HTTP API (tokenmill launch --help)
  plugins           list the registered backends, attention kernels, schedulers and KV allocators
  watermark-detect  test text for the watermark `launch` adds (tokenmill watermark-detect --help)
  gateway-config    print an nginx or Envoy config serving several models from one address, by the
                    x-model header (tokenmill gateway-config --help)
  version           print the version
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "launch":
        collector.hold_full_collections()  # before the imports: 0.85 s of full collections, on SmolLM2's start
        from tokenmill.cli.launch import launch

        return launch(rest)
    if command == "plugins":
        from tokenmill.cli.plugins import list_plugins

        return list_plugins(rest)
    if command == "watermark-detect":
        from tokenmill.cli.watermark import watermark_detect

        return watermark_detect(rest)
    if command == "gateway-config":
        from tokenmill.cli.gateway import gateway_config

        return gateway_config(rest)
    if command in ("version", "--version"):
        print(__version__)
        return 0
    print(f"tokenmill: error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
