"""``python -m bench``: the table of scenarios is ``bench/cli.py``; ``bench/README.md`` explains each."""

from bench.cli import main

main()
