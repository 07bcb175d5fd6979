"""Copy the generated result tables into benchmarks/README.md: ``python benchmarks/readme_tables.py`` (after the
reports).

Each table lives there between ``<!-- NAME-table: COMMAND -->`` and ``<!-- /NAME-table -->``; this replaces
what is between them with ``benchmarks/results/NAME.md`` from its first ``### `` heading on (one heading level
down), so the README's figures are the reports' and nothing is typed by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
README = ROOT / "README.md"  # benchmarks/README.md
TABLES = {"authors": "### Main table", "compressed": "### ", "netlink": "| method"}


def block(name: str, start: str) -> str:
    md = (ROOT / "results" / f"{name}.md").read_text()
    body = md[md.index(start):].strip()
    return re.sub(r"^### ", "#### ", body, flags=re.M)


def main() -> int:
    readme = README.read_text()
    for name, start in TABLES.items():
        pattern = re.compile(rf"(<!-- {name}-table: [^>]*-->\n).*?(<!-- /{name}-table -->)", re.S)
        if not pattern.search(readme):
            print(f"README.md has no {name}-table block; left as it is")
            continue
        readme = pattern.sub(lambda m: m.group(1) + block(name, start) + "\n" + m.group(2), readme)  # noqa: B023
    README.write_text(readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
