"""The link matrix of a machine and the cost model that picks a strategy from it."""
