"""`lmfoundry traffic show|set|rollback`: the serving API's traffic split between model versions
(see serving/traffic.py)."""

import sys

from lmfoundry.serving.traffic import main

if __name__ == "__main__":
    sys.exit(main())
