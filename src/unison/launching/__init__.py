"""Launching: everything `unison launch` and `notebook_launcher` do before and around a run.

Owns the launcher (on torch.distributed.run's elastic agent), its flags and their sources (`options`,
`config_file`, `accelerate_config`, `plugin_flags`), the rendezvous store, the end-of-run report, and
the notebook launcher. It sits above the core: it may import the core (state, env_vars, network,
parallel.config, plugins), health and observing, never commands. The core learns how it was launched
only through the UNISON_* variables of `unison.env_vars`, a contract both sides import.
"""
