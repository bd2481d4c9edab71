"""``python -m mpifusion.tools.bench``: the same as ``mpifusion bench``."""
import sys

from . import main

sys.exit(main())
