"""`python -m mconv.cli`: the mconv program, as the console script runs it."""
from mconv.cli import entry

entry()
