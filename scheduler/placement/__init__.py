"""Placement: the pure decision and its inputs, and the service's edge (gather, decide, commit,
send).
"""
