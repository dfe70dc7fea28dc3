"""Stack per-stage CSVs with the same header into one table."""

import csv

from common import start

start(snakemake, torch_threads=False)

from hybrid_llama.files import atomic_path

header, rows = None, []
for path in snakemake.input:
    with open(path, newline="") as f:
        reader = csv.reader(f)
        head = next(reader)
        if header is not None and head != header:
            raise ValueError(f"{path}: header {head} differs from {header}")
        header = head
        rows.extend(reader)
with atomic_path(snakemake.output[0]) as tmp, open(tmp, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(header)
    writer.writerows(rows)
print(f"{len(rows)} rows from {len(snakemake.input)} files")
