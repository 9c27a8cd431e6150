"""Reproduction grids, planned and run: each published configuration beside the command that
reproduces it (grid), what a row needs (needs) and costs (estimates, first_stage), and the
planner that says which tasks are done or stale, runs the rest and builds the table (planner).
The comparison tables and reports they end in are :mod:`r2med_agent.analysis`.
Rows run one after another, or as tasks on a Ray cluster (cluster: the driver and its single
writer, rows: what a row ships to a worker and back, schedule: stages, resources and packing)."""
