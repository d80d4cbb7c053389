"""Running ggufq on one machine: the local stack, embedded Redis, child processes, health checks,
Flower.
"""
