import sys

from autoshard.cli import main

sys.exit(main())
