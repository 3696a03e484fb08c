"""``python -m pipeplan``: the command line, as the ``pipeplan`` script runs it."""

from pipeplan.cli import main

main()
