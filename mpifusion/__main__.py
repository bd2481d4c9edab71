"""``python -m mpifusion``: the same command as ``mpifusion``."""
import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
