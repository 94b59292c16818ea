import sys

from engine_core.main import main

sys.exit(main())
