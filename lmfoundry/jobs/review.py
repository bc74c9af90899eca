"""The human review queue of preference pairs: list, claim, decide, comment.

lmfoundry review --db work/pairs/review.sqlite list --status pending
"""

import sys

from lmfoundry.align.review import main

if __name__ == "__main__":
    sys.exit(main())
