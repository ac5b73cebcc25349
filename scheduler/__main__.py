import sys

from scheduler.cli import main

sys.exit(main())
