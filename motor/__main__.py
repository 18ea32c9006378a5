"""`python -m motor` = the `motor` console script."""

from motor.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
