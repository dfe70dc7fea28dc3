"""Compare two workflow output trees file by file, ignoring what legitimately differs between runs.

    python tests/tools/compare_results.py BEFORE_DIR AFTER_DIR

Each directory is a workflow's working directory; ``results/`` and ``resources/data/`` are compared.
Files must exist on both sides. Safetensors, adapters and every other file are compared byte for
byte, except:
- CSV files: columns whose name says they hold a time or a rate (``*_s``, ``*tokens_per_s*``,
  ``elapsed``, ``time``...), a peak memory measurement or a count of timed calls are dropped, the
  rest must match exactly;
- JSON files: keys naming a time, a date, a host or a library version are dropped at any depth, and
  lists of strings compare as sets (peft writes ``target_modules``, a set, in hash order);
- logs, benchmark tables, plots (PNG/SVG: matplotlib embeds dates) and the HTML report are skipped.
Exit status 0 when everything matches; otherwise each difference is printed.
"""

from __future__ import annotations

import csv
import io
import json
import re
import sys
from pathlib import Path

TREES = ("results", "resources/data")
SKIP = re.compile(r"(^|/)(logs|benchmarks|plots)/|\.(png|svg|pdf|html|log)$")
VOLATILE = re.compile(
    r"(^|_)(s|sec|secs|seconds|time|elapsed|date|timestamp|when|host|hostname|wall|ms|us|version|versions|"
    r"tokens_per_s|tok_s|speed|throughput|spread|repeats_s|duration|started|finished|python|torch|transformers|"
    r"lm_eval|platform|cpu_name|device_name|gpu|this_run)(_|$)|per_s|_s$"
    # measured, not computed: a CPU run's peak resident set, how many calls fit a round's minimum time,
    # and the ratio of two timings
    r"|^peak_mem_bytes$|^prefill_calls$|^speedup(_min|_max)?$",
    re.I,
)


def _strip_json(obj):
    if isinstance(obj, dict):
        return {k: _strip_json(v) for k, v in obj.items() if not VOLATILE.search(str(k))}
    if isinstance(obj, list):
        if all(isinstance(x, str) for x in obj):
            return sorted(obj)  # peft writes sets (target_modules) in hash order
        return [_strip_json(x) for x in obj]
    return obj


def _csv_rows(data: bytes) -> list[dict]:
    rows = list(csv.DictReader(io.StringIO(data.decode())))
    return [{k: v for k, v in r.items() if not VOLATILE.search(k or "")} for r in rows]


def same(a: Path, b: Path) -> bool:
    da, db = a.read_bytes(), b.read_bytes()
    if da == db:
        return True
    if a.suffix == ".json":
        return _strip_json(json.loads(da)) == _strip_json(json.loads(db))
    if a.suffix == ".csv":
        return _csv_rows(da) == _csv_rows(db)
    return False


def files(root: Path) -> set[str]:
    out = set()
    for tree in TREES:
        base = root / tree
        if base.is_dir():
            out |= {p.relative_to(root).as_posix() for p in base.rglob("*") if p.is_file()}
    return {f for f in out if not SKIP.search(f) and "/checkpoints/" not in f and f != "results/.gitkeep"}


def compare(before: Path, after: Path) -> list[str]:
    fa, fb = files(before), files(after)
    problems = [f"only in {before}: {f}" for f in sorted(fa - fb)]
    problems += [f"only in {after}: {f}" for f in sorted(fb - fa)]
    problems += [f"differs: {f}" for f in sorted(fa & fb) if not same(before / f, after / f)]
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = map(Path, argv)
    problems = compare(before, after)
    for p in problems:
        print(p)
    n = len(files(before) & files(after))
    print(f"{n} files compared, {len(problems)} differences", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
