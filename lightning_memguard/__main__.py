import sys

from lightning_memguard.cli import main

sys.exit(main())
