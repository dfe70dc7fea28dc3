"""How long a DAG takes on N cores, replayed from the benchmark files of a finished run.

Snakemake starts, whenever cores are free, the ready jobs of highest priority that fit; a job that
needs two cores waits while one-core jobs keep filling the one core that frees. This replays that
policy with every job's time from its ``benchmark:`` file, over several random orders of jobs of
equal priority (Snakemake's choice among them is not documented), and prints the makespans beside
the bound the core-minutes allow. It is how the rules' priorities were chosen (docs/performance.md).

    .venv/bin/snakemake results/report.html --forceall -n > /tmp/dry.txt
    .venv/bin/python benchmarks/schedule_sim.py /tmp/dry.txt --cores 2 --orders 12
"""

from __future__ import annotations

import argparse
import csv
import random
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    rule: str
    outputs: list[str]
    inputs: list[str]
    threads: int
    priority: int
    seconds: float
    timed: bool
    deps: set[int] = field(default_factory=set)


def _field(block: str, key: str) -> str | None:
    m = re.search(rf"^\s+{key}: (.*)$", block, re.M)
    return m.group(1) if m else None


def _files(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def read_dry_run(text: str, root: Path, untimed_s: float) -> dict[int, Job]:
    """The jobs of a ``snakemake -n`` listing, each with the time its benchmark file recorded."""
    jobs: dict[int, Job] = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", text):
        head = re.match(r"(?:local)?rule (\w+):", block)
        jobid = _field(block, "jobid")
        if not head or jobid is None:
            continue
        bench = _field(block, "benchmark")
        seconds, timed = untimed_s, False
        if bench and (root / bench).exists():
            rows = list(csv.DictReader((root / bench).open(), delimiter="\t"))
            seconds, timed = float(rows[-1]["s"]), True
        jobs[int(jobid)] = Job(head.group(1), _files(_field(block, "output")), _files(_field(block, "input")),
                               int(_field(block, "threads") or 1), int(_field(block, "priority") or 0),
                               seconds, timed)
    producer = {out: jid for jid, job in jobs.items() for out in job.outputs}
    for job in jobs.values():
        job.deps = {producer[f] for f in job.inputs if f in producer}
    return jobs


def makespan(jobs: dict[int, Job], cores: int, rng: random.Random) -> float:
    """Seconds until the last job ends, starting ready jobs by priority (ties in ``rng``'s order)."""
    now, free = 0.0, cores
    running: list[tuple[float, int, int]] = []  # (end, jobid, cores held)
    done: set[int] = set()
    started: set[int] = set()
    while len(done) < len(jobs):
        ready = [j for j, job in jobs.items() if j not in started and job.deps <= done]
        rng.shuffle(ready)
        ready.sort(key=lambda j: -jobs[j].priority)  # stable: ties keep the shuffled order
        for j in ready:
            need = min(jobs[j].threads, cores)
            if need <= free:
                free -= need
                started.add(j)
                running.append((now + jobs[j].seconds, j, need))
        if not running:
            raise RuntimeError("no job can start: a dependency cycle or a job needing more cores")
        running.sort()
        now = running[0][0]
        while running and running[0][0] <= now:
            _, j, held = running.pop(0)
            done.add(j)
            free += held
    return now


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dry_run", help="the output of `snakemake TARGET --forceall -n`")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--orders", type=int, default=12, help="random orders of equal-priority jobs")
    ap.add_argument("--root", default=".", help="where the benchmark paths are relative to")
    ap.add_argument("--untimed-s", type=float, default=5.0, help="seconds for a job with no benchmark file")
    args = ap.parse_args(argv)
    jobs = read_dry_run(Path(args.dry_run).read_text(), Path(args.root), args.untimed_s)
    spans = sorted(makespan(jobs, args.cores, random.Random(seed)) / 60 for seed in range(args.orders))
    core_min = sum(job.seconds * min(job.threads, args.cores) for job in jobs.values()) / 60
    untimed = sum(not job.timed for job in jobs.values())
    print(f"{len(jobs)} jobs ({untimed} without a benchmark file, {args.untimed_s:g} s each), "
          f"{core_min:.1f} core-min: at least {core_min / args.cores:.1f} min on {args.cores} cores")
    print(f"makespan over {args.orders} orders: min {spans[0]:.1f}, median {statistics.median(spans):.1f}, "
          f"max {spans[-1]:.1f} min")


if __name__ == "__main__":
    main()
