"""`python -m mconv`: the same command line as the `mconv` entry point."""
from mconv.cli import entry

entry()
