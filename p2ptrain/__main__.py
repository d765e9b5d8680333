import sys

from p2ptrain.cli.main import main

sys.exit(main())
