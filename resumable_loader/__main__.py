"""``python -m resumable_loader``: the command line tools (``resumable_loader/cli``)."""

from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
