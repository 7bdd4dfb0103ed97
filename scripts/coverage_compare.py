"""Two coverage JSON reports of grpo_cli/ (scripts/suite_coverage.sh), before and after a change to the suite or
the layout: the totals, and every function some test ran before that no test runs after. Modules moved, so a
function is matched by its qualified name; names found only before are listed for a reader to match by hand.

    .venv/bin/python scripts/coverage_compare.py BEFORE/cov.json AFTER/cov.json
"""

from __future__ import annotations

import json
import sys


def functions(report: dict) -> dict[str, int]:
    """Qualified function name -> lines of it that ran (summed over modules holding that name)."""
    ran: dict[str, int] = {}
    for entry in report["files"].values():
        for name, fn in entry.get("functions", {}).items():
            if name:  # "" is the module's own top level
                ran[name] = ran.get(name, 0) + fn["summary"]["covered_lines"]
    return ran


def main(before_path: str, after_path: str) -> None:
    before, after = (json.loads(open(p).read()) for p in (before_path, after_path))
    for label, report in (("before", before), ("after", after)):
        t = report["totals"]
        print(f"{label}: {t['covered_lines']} of {t['num_statements']} statements run, {t['percent_covered']:.1f}%")
    ran_before, ran_after = functions(before), functions(after)
    lost = sorted(n for n, lines in ran_before.items() if lines and ran_after.get(n) == 0)
    missing = sorted(n for n, lines in ran_before.items() if lines and n not in ran_after)
    print(f"run before, not run after ({len(lost)}): {', '.join(lost) or '-'}")
    print(f"run before, no function of that name after ({len(missing)}): {', '.join(missing) or '-'}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
