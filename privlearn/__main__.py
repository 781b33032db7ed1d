"""``python -m privlearn``: the same as the ``privlearn`` console script."""

from privlearn.cli import main

if __name__ == "__main__":
    main()
