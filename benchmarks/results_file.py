"""A by-hand benchmark's results file: its command line, when and where it ran, then its table; printed too."""

from __future__ import annotations

import datetime
import shlex
import sys
from pathlib import Path

from benchmarks.bench_serve_spec import machine

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(script: str, argv, details: str, table: list[str], out: Path | None = None) -> Path:
    """Print and write `table` under the command (`script` and its argv, sys.argv's when None) and a line of the
    UTC time, the machine and `details`; `out` defaults to benchmarks/results/<script's stem>_<UTC date>.md."""
    command = f"benchmarks/{script} " + shlex.join(argv if argv is not None else sys.argv[1:])
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"`{command}`", "", f"{now:%Y-%m-%d %H:%M} UTC; {machine()}; {details}", "", *table]
    print("\n".join(lines))
    out = out or RESULTS / f"{Path(script).stem}_{now:%Y-%m-%d}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return out
