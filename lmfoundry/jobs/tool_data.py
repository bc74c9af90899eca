"""Verified tool-use conversations for an agent workflow (the orders demo): questions from
templates and the real database, real tool calls, answers checked against the database; train
and test splits with held-out phrasings and values.

    lmfoundry agents demo-data --out work/agents
    lmfoundry tool-data configs/tool_data.yaml --output work/tool_data
"""

import sys

from lmfoundry.agents.tool_data import ToolDataConfig, run_tool_data
from lmfoundry.platform.cli import run_stage


def main(argv=None) -> int:
    return run_stage(
        "tool-data", ToolDataConfig, run_tool_data, argv, input_field=None, description=__doc__, needs_ray=False
    )


if __name__ == "__main__":
    sys.exit(main())
