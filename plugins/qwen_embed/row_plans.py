"""The row counts the oneDNN-packed GEMMs (onednn.PackedWeight) run with, without torch: the
launcher sizes oneDNN's plan cache from them.

oneDNN plans each GEMM for its row count and keeps the plan in its primitive cache. Varlen
batches bring a new row count nearly every forward, so small forwards would pay the planning
on every GEMM and fill the cache with one-off plans. Row counts from 17 to 512 are therefore
padded up to a few planned counts (above 512 rows planning is a small share of the GEMM), and
the launcher bounds the cache (PRIMITIVE_CACHE_CAPACITY). A row's result does not depend on the
padding. A single row runs as two: oneDNN's one-row fp32 path sums in another order than its
GEMM, so a text alone would get other numbers than in a batch. Measurements: docs/tuning.md.
"""

from __future__ import annotations

# Row counts up to UNPADDED_ROWS run as they are (few counts anyway); above, up to each limit,
# they are padded to a multiple of its step: steps grow with the count so that the padding
# stays a small share of the rows, since a GEMM's time grows with its rows.
UNPADDED_ROWS = 16
ROW_STEPS = ((32, 2), (64, 4), (256, 8), (512, 16))  # (up to rows, step)
PADDED_ROWS_MAX = ROW_STEPS[-1][0]
# The launcher's oneDNN primitive cache size (set before tritonserver starts: oneDNN reads it
# once): room for the planned counts' plans of every GEMM shape of a Qwen model with last-layer
# pruning (q|k|v, o, gate|up, down, q, k|v), and a bound on memory.
PRIMITIVE_CACHE_CAPACITY = 512


def planned_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs with: few distinct counts, so oneDNN's cached
    plans are reused, each close above the real count; never one row."""
    if rows == 1:
        return 2
    if UNPADDED_ROWS < rows <= PADDED_ROWS_MAX:
        step = next(step for limit, step in ROW_STEPS if rows <= limit)
        return -(-rows // step) * step
    return rows
