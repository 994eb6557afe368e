"""`python -m bench`: see bench/harness.py."""

from bench.harness import main

main()
