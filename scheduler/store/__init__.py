"""Cluster state in Redis: key names, Lua scripts, state by role, chunk streams, cancellation, the
connection.
"""
