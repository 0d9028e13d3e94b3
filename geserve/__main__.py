"""`python -m geserve` entry point."""

from geserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
