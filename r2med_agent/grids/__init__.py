"""Reproduction grids: planning, scheduling and running their rows (here: on a Ray cluster)."""
