"""`python -m motor` = the `motor` console script."""

from motor.cli import console

if __name__ == "__main__":
    console()
