import sys

from kvstore_bench.cli import main

sys.exit(main())
