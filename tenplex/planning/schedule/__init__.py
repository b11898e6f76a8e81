"""Traffic-engineered transfer schedules for a plan (TE-CCL style; pure: no I/O).

A :class:`~tenplex.planning.planner.Plan` says which pieces every new rank needs; this package decides
*how* they travel over a :class:`~tenplex.planning.topology.Topology`: from which live replica (any
alive old holder of the interval, a super-source), along which links, through which host
memories (store-and-forward), in which epoch, and with one transmission serving several new
ranks that need the same piece (multicast). Pieces are aggregated into *commodities* (same
candidate sources, same destinations) and split into chunks, so a GPT-3 plan of 10^5 moves
becomes a few hundred commodities and a few thousand chunks.

Methods (see docs/schedule.md):

- ``milp``: time-expanded MILP over route options (TE-CCL with copy), integer chunks; small
  instances only.
- ``lp``: the LP of the fluid limit (min-congestion multicast routing with source choice over
  the same route options, solved by HiGHS), rounded to chunks and list-scheduled in epochs.
- ``greedy``: load-aware source choice on shortest-path trees, list-scheduled in epochs.
- ``auto``: greedy first (the fallback), then lp, then milp when small, within ``time_limit``;
  the best by simulated completion wins, unless the naive baseline is faster: then the naive
  schedule itself (method ``"naive"``).

Also: :func:`simulate` (completion of a schedule), :func:`naive_completion` (every transfer at
once on its shortest path, max-min fair sharing), :func:`lower_bound` (cut bound with best
source choice and multicast) and :meth:`Schedule.rounds` (the transfer order for a transport).

Modules: ``commodities`` (pieces and commodities of a plan), ``routes`` (route options, fastest
paths, greedy routes), ``listsched`` (list scheduling in epochs), ``solvers`` (LP, greedy
assignment, MILP), ``bounds`` (lower bound), ``naive`` (the naive baseline), ``hostpaths``
(fastest paths through the hosts' portals on large clusters), ``simulator`` (simulate,
validate), ``result`` (Schedule, Transfer), ``scheduler`` (:func:`schedule`).
"""

from .bounds import lower_bound
from .commodities import Commodity, Demands, demands
from .naive import naive_bounds, naive_completion
from .result import Schedule, Transfer
from .scheduler import METHODS, schedule
from .simulator import simulate, validate

__all__ = ["Commodity", "Demands", "Transfer", "Schedule", "schedule", "demands", "simulate", "naive_completion", "naive_bounds",
           "lower_bound", "validate", "METHODS"]
