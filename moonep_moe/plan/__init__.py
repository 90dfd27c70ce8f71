"""The planner: from the group's routing histogram to where every route is computed. A pure function of
the histogram, the same on every rank; its modules:

- `types`: the plan (`MoonEPCommPlan`) and its encodings, what every planner and the comm core share;
- `policies`: the balance policies (how far to replicate), one registry;
- `reference`: the algorithm as written below, in plain Python over host lists (the tests' oracle);
- `device`: the same in fixed-shape torch ops on the device (no host read);
- `triton`: the same in two Triton launches (CUDA);
- `planner`: `plan_routes` / `plan_one_rank`, the one place that chooses between them.

Notation and suffixes: DESIGN.md, "Notation" (S, K, E, R, `epn = E / R`, B, tp, NvS; `_re`: ranks x experts).

Every rank calls `plan_routes` with the same gathered histogram `counts_re [R, E]` and gets the same global
plan, bit for bit (no rank-0 broadcast):

1. Targets: with T valid routes, every rank computes `T // R` routes, and the `T % R` ranks with the largest
   home load (ties: lowest rank) one more.
2. Rank balancing (`balance_ranks`): repeatedly pair the rank with the largest surplus with the rank with
   the largest deficit (ties: lowest rank) and fill the receiver in one shot. A receiver is never touched
   again, so it hosts replicas of at most one remote home group: at most `epn` slots.
3. Per-donor split (`split_quotas`), donors in ascending rank: the receiver with the largest remaining quota
   takes the donor's expert with the most remaining routes, `min(both)` at a time. Each move uses one slot
   of the receiver; with `B < epn` a receiver whose slots run out stops receiving and the rest stays home
   (best effort, reported by `rank_load`).
4. Slots (`assign_slots`): a receiver's replicated experts fill its slots in ascending expert id.
5. Segments (`segment_layout`): on each rank the E+B groups in row order (the E global experts, of which
   only the home ones can be non-empty, then the B slots), each non-empty one padded to a multiple of tp;
   this rank's compute groups (`compute_groups`: home experts then slots) are what an engine runs.
6. Routes (`route_destinations`): an expert's routes are ordered by (source rank, token, k) and the ranks
   computing it take contiguous ranges of that order, in rank order. A route's `dst` is
   `dest_rank * NvS + row`; with R > 1 a later route of a token to a rank the token already visits is
   encoded `-(dest_rank * NvS + row) - 1` (it carries only its weight: the receiver copies the primary row,
   so the token crosses the link once per rank); with one rank there is no link to save and every valid
   route is primary (its row written and read directly); an invalid route (expert -1) is `NO_ROUTE`.

Replication policy (`replica_cost` c, in routes: the GEMM routes whose time equals one expert's weight
transfer, `replica_cost_routes`): c = 0 is `balance='exact'`, the algorithm above. With c > 0
(`balance='cost_aware'`) a move pays only if it takes more than c routes off its donor. Rank balancing then
moves at most the donor's surplus, so a donor never turns receiver (it would pay for transfers both ways)
and a receiver may take from several donors, whose splits share its B slots in ascending donor rank; it
stops at the first move of <= c routes (every later move is smaller), and a donor's split stops at its first
take of <= c routes (every later take is smaller); then, if the plan's hottest rank in the model
(`modelled_load`: routes computed + c per weight transfer over the rank's link) is not strictly below plain
EP's hottest rank, the whole plan falls back to plain EP (no replica, every route on its home rank). c =
`NO_REPLICATION` (`balance='off'`) moves nothing: plain EP. Balance is then best effort, so the row capacity
is that of `B < epn` (`rows_capacity`).

Two implementations of steps 1-5 compute the same global plan, bit for bit:

- `plan_global` (and its helpers) is the reference oracle: plain Python over host lists, the algorithm as
  written above. Tests compare the device planner against it.
- `plan_global_device` is what `plan_routes` runs: fixed-shape torch ops on the histogram's device with no
  host read and no value-dependent shape (no `.item()`, `.tolist()`, `nonzero`, mask indexing, `bincount`),
  so a GPU step can be captured in a CUDA graph. Its loops have trip counts fixed by R, E and B: once a
  loop of the reference would have stopped, every further iteration is masked to a no-op. Ties break with
  an explicit combined key (`_first_argmax`), never by relying on `argmax`'s tie order.

Step 6 (`route_destinations`) is one implementation, sync-free on every device.

On CUDA (with Triton) `plan_routes` runs steps 1-6 as two Triton launches instead
(`moonep_moe.plan.triton`, equal to these bit for bit); elsewhere the torch path above.
"""
