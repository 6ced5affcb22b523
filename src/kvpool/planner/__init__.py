"""Capacity planning: model specs, the constraints a step puts on the pools, and how many slots
each layer group gets in each memory tier (:mod:`~kvpool.planner.capacity`)."""
