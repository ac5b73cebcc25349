import sys

from sae_dist.cli import main

sys.exit(main())
