"""Health: no silent hangs, one clear failure.

Owns how a run that goes wrong ends: the hang watchdog (`watchdog`: a stalled or mismatched collective
reported with every rank's position), failure propagation (`failure`: the first rank that raises is
named once, its peers end within seconds), where in the user's code a rank is (`position`), the error
file torch's elastic agent reads (`elastic_record`), the errors every rank raises alike (`mismatch`)
and other processes as /proc shows them (`processes`). It may import torch and the standard library
only: the core (state, ops) imports it, so it never imports the core back.
"""
