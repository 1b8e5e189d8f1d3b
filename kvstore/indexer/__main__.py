import sys

from kvstore.indexer.cli import main

sys.exit(main())
