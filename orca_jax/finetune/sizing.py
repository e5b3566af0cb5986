"""A job's micro-batch sized from the memory fine-tuning may use, when the job names no micro_batch_tokens
(no jax: the caller's `measure` compiles).

A micro step's memory is only known once compiled (XLA's memory analysis), and compiling SmolLM2's
takes 20-90 s on a CPU, so the search compiles as few sizes as it can: the largest (what a job gets
when it fits: one compile), then one row, then the rows a line through those two points says fit,
refined from the nearest measured sizes while the line misses. Memory grows about linearly with the
rows (SmolLM2 on CPU, rows of 128 tokens: 0.60, 1.54 and 4.85 GiB at 1, 4 and 16 rows), so the third
compile is usually the last.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_REFINEMENTS = 3  # compiles past the first three, when memory is not linear in the rows


def fit_rows(measure: Callable[[int], int], max_rows: int, budget_bytes: int | None) -> int:
    """The most rows, at most max_rows, whose measured bytes fit budget_bytes (None: no limit), as
    far as MAX_REFINEMENTS compiles past the line's guess find them (all of them where memory is
    linear in the rows); every answer was measured to fit. `measure(rows)` compiles that size and
    returns its bytes, called once per size tried. Returns 1 when even one row does not fit (the
    caller refuses the job with that size's figures)."""
    measured: dict[int, int] = {}

    def bytes_at(rows: int) -> int:
        if rows not in measured:
            measured[rows] = measure(rows)
        return measured[rows]

    if budget_bytes is None or bytes_at(max_rows) <= budget_bytes or max_rows == 1:
        return max_rows
    if bytes_at(1) > budget_bytes:
        return 1
    fits, fails = 1, max_rows  # the most rows known to fit, the fewest known not to
    for _ in range(1 + MAX_REFINEMENTS):
        per_row = max(bytes_at(fails) - bytes_at(fits), 1) / (fails - fits)
        guess = min(fails - 1, fits + int((budget_bytes - bytes_at(fits)) // per_row))
        if guess <= fits:
            break
        if bytes_at(guess) <= budget_bytes:
            fits = guess
        else:
            fails = guess
    return fits
