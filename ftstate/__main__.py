"""``python -m ftstate``: the same as the ``ftstate`` command."""

from ftstate.cli import main

if __name__ == "__main__":
    main()
