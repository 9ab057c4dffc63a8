"""`python -m mconv`: the same program as the `mconv` console script."""
from mconv.program import main

main()
