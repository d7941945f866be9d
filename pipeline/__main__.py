"""`python -m pipeline`: the `pipeline` command. (An entry point.)"""

from pipeline.cli import main

main()
