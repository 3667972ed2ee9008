import sys

from executor.client.cli import main

sys.exit(main())
