"""Serve a checkpoint behind the OpenAI-compatible API on Ray Serve, until interrupted.

LMFOUNDRY_API_KEYS=my-key python -m lmfoundry.jobs.serve configs/serve.yaml --input work/pretrain

A checkpoint that failed its evaluation gate is refused; --force-gate-failed serves it anyway
(and the log says so).
"""

import sys
import time

from lmfoundry.platform.cli import run_stage
from lmfoundry.platform.log import get_logger
from lmfoundry.serving.app import ServeConfig, start

logger = get_logger(__name__)


def serve_forever(cfg: ServeConfig) -> dict:
    from ray import serve

    url, generated_key = start(cfg)
    logger.info("serving %s at %s/v1 (Ctrl-C stops)", cfg.model_name, url)
    if generated_key:
        # The key itself goes to stdout once, never to a logger (log handlers ship lines elsewhere).
        logger.warning("no keys in $%s: this server accepts one generated key, printed on stdout", cfg.api_keys_env)
        print(generated_key, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return {"url": url, "stopped": True}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--force-gate-failed" in argv:  # shorthand for --set force_gate_failed=true
        at = argv.index("--force-gate-failed")
        argv[at : at + 1] = ["--set", "force_gate_failed=true"]
    return run_stage(
        "serve", ServeConfig, serve_forever, argv, input_field="checkpoint", output_field=None, description=__doc__
    )


if __name__ == "__main__":
    sys.exit(main())
