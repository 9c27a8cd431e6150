"""Analysis: result rows, published scores, comparison tables and their renderers, reports,
statistics, and the reproduction grids with their planner."""
