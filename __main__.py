"""`python -m fluidps`: the same as the `fluidps` command.

May import: anything
"""

from fluidps.cli import main

main()
