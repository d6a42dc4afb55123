"""Observing: what a run reports about itself while it trains.

Owns experiment trackers with Accelerate's API (`tracking/`), the progress bar (`progress`),
tokens/s and MFU (`throughput`), loss plots from tracker files (`plotting`) and the profiler
(`profiling`). It may import the core's engines (state, env_vars, kwargs_handlers) and health; the
training loop (accelerator) imports it, so it never imports the loop, planning, launching or commands.
"""
