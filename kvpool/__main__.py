"""``python -m kvpool``: the ``kvpool`` command line, as the installed ``kvpool`` script runs it."""

from kvpool.cli import main

if __name__ == "__main__":
    main()
