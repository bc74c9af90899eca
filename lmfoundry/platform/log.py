"""One logging helper for the whole project; in distributed code only rank 0 speaks."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    """A logger under the `lmfoundry` hierarchy, writing to stderr once per process."""
    root = logging.getLogger("lmfoundry")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("LMFOUNDRY_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logging.getLogger(name if name.startswith("lmfoundry") else f"lmfoundry.{name}")


def is_rank_zero() -> bool:
    """True outside distributed training and on the worker of world rank 0 inside it."""
    return int(os.environ.get("RANK", "0")) == 0


def log0(logger: logging.Logger, msg: str, *args) -> None:
    """Log at INFO from rank 0 only, so that N workers do not print N copies of each line."""
    if is_rank_zero():
        logger.info(msg, *args)
