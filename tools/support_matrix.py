"""Regenerates the committed support matrices (docs/support/) and README's summary of them.

    .venv/bin/python tools/support_matrix.py -j 2                   # every task, resumable
    .venv/bin/python tools/support_matrix.py -j 2 --task causal-lm --force   # rerun one task
    .venv/bin/python tools/support_matrix.py --readme               # README block only

Each task's rows go to docs/support/support-<task>.{json,md,html} as they finish (an
interrupted run resumes where it stopped; --force reruns everything). README's block
between the support-summary markers is then rewritten from those JSON files, so README,
markdown and HTML state the same counts (tests/test_support.py checks it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from neuronlocal.support import matrix, render
from neuronlocal.support.configs import BadInput

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "support"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", action="append", choices=matrix.TASKS,
                        help="a task to run (repeatable; default: all)")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--max-memory", type=float, default=6.0, metavar="GIB")
    parser.add_argument("--force", action="store_true", help="rerun rows already done")
    parser.add_argument("--readme", action="store_true", help="only rewrite README's block")
    args = parser.parse_args()
    if not args.readme:
        for task in args.task or matrix.TASKS:
            try:
                data = matrix.run_matrix(task, OUT, jobs=args.jobs, timeout=args.timeout,
                                         force=args.force, max_memory=args.max_memory * matrix.GiB)
            except BadInput as e:
                print(f"error: {e}")
                return 2
            print(render.headline(data))
    changed = render.update_readme(ROOT / "README.md", OUT)
    print("README.md " + ("updated" if changed else "already up to date"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
