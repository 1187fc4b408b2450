"""The optimal solver's limits (docs/planner.md, "Large trees").

An exact pass may visit ``EXACT_WORK`` frontier points; past that, passes are approximate:
frontiers are thinned to ``THIN_POINTS`` points (``SEGMENT_POINTS`` where segments start
from) and segments of long chains start only at geometric distances (1, 2, 3, 4, 6, 8, 12,
...) before their end. Every plan is still valid and exactly evaluated; a cheaper one may
have been dropped. The (peak, time) frontier is walked point by point for at most
``STAIRCASE`` passes (every pass on trees of at most ``SMALL_TREE`` units), then sampled at
``SAMPLED`` caps (trees that needed approximate passes get only its ends). An approximate
plan is walked for once more, under its own time, when the first walk visited fewer than
``REFINE_WORK`` points; it is also planned block by block, each block walked exactly within
``BLOCK_WORK`` points. The cheaper plan within a budget's reserve (a solution's ``edge``) is
found on such trees by keeping at most ``EDGE_PIECES`` more of the plan's recomputed pieces.

The solvers read these as ``limits.NAME`` when they run, so that a test can lower them.
"""

EXACT_WORK = 150_000
REFINE_WORK = 450_000
BLOCK_WORK = 50_000
THIN_POINTS = 128
SEGMENT_POINTS = 16
STAIRCASE = 24
SAMPLED = 12
SMALL_TREE = 64
EDGE_PIECES = 16
