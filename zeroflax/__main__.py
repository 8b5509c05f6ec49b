import sys

from zeroflax.cli import main

sys.exit(main())
