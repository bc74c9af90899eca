"""`lmfoundry keys create|list|revoke`: the serving API's tenant keys (see serving/keys.py)."""

import sys

from lmfoundry.serving.keys import main

if __name__ == "__main__":
    sys.exit(main())
