"""How numbers read on the page, where more than one part of the report prints them: a value with
its standard error, and a memory size."""

from __future__ import annotations

import math
from typing import Any

from hybrid_llama.report.results import num


def plus_minus(x: float, se: float, digits: int = 3) -> str:
    """'+0.41 ± 0.03': signed, to the stderr's first significant digit (two if it starts with 1);
    ``digits`` decimals when the stderr is zero or unknown (NaN: no '±' part)."""
    if not math.isnan(se) and se > 0:
        digits = -math.floor(math.log10(se))
        digits = min(4, max(1, digits + (se * 10**digits < 2)))
    x = 0.0 if round(x, digits) == 0 else x  # no "-0.000"
    return f"{x:+.{digits}f}" + ("" if math.isnan(se) else f" ± {se:.{digits}f}")


def byte_size(x: Any) -> str:
    """'512.00 MiB', '1.50 GiB': bytes with their unit (the headline and the memory table show the
    same figure the same way); '–' for a blank or failed measurement."""
    v = num(x)
    if math.isnan(v):
        return "–"
    return f"{v / 2**20:,.2f} MiB" if v < 2**30 else f"{v / 2**30:,.2f} GiB"
