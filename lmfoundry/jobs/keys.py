"""`lmfoundry keys create|list|revoke`: the serving API's tenant keys (see platform/keys.py)."""

import sys

from lmfoundry.platform.keys import main

if __name__ == "__main__":
    sys.exit(main())
