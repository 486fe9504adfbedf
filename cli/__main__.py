"""`python -m cli` = the `depthtools` command."""

from cli.main import main

main()
