"""Write README's family table from the tests: every family x drafter of tests/test_families.py
(and the bfloat16/float16 cases of tests/test_half_precision.py), run as the whole matrix.

    python scripts/family_table.py                    # runs the tests (SPECFX_ALL_FAMILIES=1), then writes
    python scripts/family_table.py --junit a.xml b.xml   # from finished pytest --junitxml runs

The table goes between the `<!-- families:begin -->` and `<!-- families:end -->` lines of
README.md. A cell is "exact" (the test passed), "refused" (a clear error at compile time, as the
test expects), "FAIL" (it failed) or "-" (not run).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import FAMILIES, REFUSED  # noqa: E402
from test_families import DRAFTERS, REFUSED_DRAFTERS  # noqa: E402

BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"
# Family names have no "-"; drafter names may ("early-exit:1").
CASE = re.compile(r"^test_family_greedy_equals_model_generate\[([^-]+)-(.+)\]$")
HALF = re.compile(r"^test_half_precision_greedy_equals_model_generate\[([^-]+)-(\w+)-(.+)\]$")
REFUSAL = re.compile(r"^test_unsupported_family_is_refused_naming_the_part\[(.+)\]$")


def run_tests(junit: Path) -> None:
    env = dict(os.environ, SPECFX_ALL_FAMILIES="1")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "tests/test_families.py",
                    "tests/test_half_precision.py",
                    f"--junitxml={junit}"], cwd=ROOT, env=env, check=False)


def results(junit: Path) -> dict[str, str]:
    """Test name -> "exact" / "FAIL" / "skipped"."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        out[case.get("name")] = "skipped" if case.find("skipped") is not None else "FAIL" if failed else "exact"
    return out


def table(res: dict[str, str]) -> str:
    cells: dict[tuple[str, str], str] = {}
    half: dict[tuple[str, str], list[str]] = {}
    for name, outcome in res.items():
        if m := CASE.match(name):
            key = (m.group(1), m.group(2))
            cells[key] = ("refused" if outcome == "exact" else outcome) if key in REFUSED_DRAFTERS else outcome
        elif m := HALF.match(name):
            half.setdefault((m.group(1), m.group(2)), []).append(outcome)
    lines = ["| family | structural variants | " + " | ".join(DRAFTERS) + " | bf16 / fp16 (all drafters) |",
             "|---|---|" + "---|" * (len(DRAFTERS) + 1)]
    for family, (variants, _) in FAMILIES.items():
        row = [cells.get((family, d), "-") for d in DRAFTERS]
        h = " / ".join(_summary(half.get((family, dt))) for dt in ("bfloat16", "float16"))
        lines.append(f"| {family} | {variants} | " + " | ".join(row) + f" | {h if half.get((family, 'bfloat16')) else '-'} |")
    for family, why in REFUSED.items():
        outcome = res.get(f"test_unsupported_family_is_refused_naming_the_part[{family}]", "-")
        verdict = f"refused at compile time: \"{why}\"" + ("" if outcome == "exact" else f" ({outcome})")
        lines.append(f"| {family} | {verdict} | " + " | ".join("-" for _ in DRAFTERS) + " | - |")
    return "\n".join(lines)


def _summary(outcomes: list[str] | None) -> str:
    if not outcomes:
        return "-"
    return "exact" if all(o == "exact" for o in outcomes) else f"{outcomes.count('FAIL')} FAIL"


def write_readme(text: str) -> None:
    readme = ROOT / "README.md"
    body = readme.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    head, rest = body.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--junit", nargs="+", default=None,
                   help="read these pytest --junitxml files instead of running the tests")
    args = p.parse_args()
    junits = [Path(j) for j in args.junit] if args.junit else [Path(tempfile.mkdtemp()) / "family_tests.xml"]
    if not args.junit:
        run_tests(junits[0])
    res = {}
    for junit in junits:
        res.update(results(junit))
    text = table(res)
    write_readme(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
