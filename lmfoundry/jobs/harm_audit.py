"""Apply reviewers' labels of a curation run's audit sample to its harmful-content violation rate.

lmfoundry harm-audit work/curated --labels labels.jsonl

The run wrote its sample to RUN/audit/harm_sample.jsonl; the labels are a JSONL file of
{"id", "harmful": true/false} (that file with its `harmful` fields filled in will do). The
checklist item in RUN/report.json and report.html is rewritten; nothing is curated again.
"""

import argparse
import json
import sys

from lmfoundry.data.report import apply_harm_labels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="lmfoundry harm-audit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("run", help="a finished curation run (its output directory, local or s3://)")
    p.add_argument("--labels", required=True, help='JSONL of {"id", "harmful": true/false}')
    p.add_argument("--enforce", action="store_true", help="exit 1 when the item fails")
    args = p.parse_args(argv)
    try:
        item = apply_harm_labels(args.run, args.labels)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: harm-audit: {e}", file=sys.stderr)
        return 2
    print(json.dumps(item, indent=2))
    return 1 if args.enforce and not item["passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
