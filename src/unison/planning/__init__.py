"""Planning: which parallel layout fits a model and a machine, and how fast it will run.

Owns the planner and its report (`planner`), the cost model and step-time estimate (`cost_model`,
`speed`, `stages`), memory and activation estimates (`memory`, `memory_terms`, `layout_memory`,
`activation_memory`), the device table and the hardware (`devices`, torch-free for the command line's
parsers; `hardware`), the planner's inputs and measurements (`inputs`, `measure`) and the
layout chosen at `prepare()` under `parallelism="auto"` (`auto`). It may import the core's engines
(state, ops, parallel/ layouts and configs) and health; the training loop (accelerator, preparation)
imports it, so it never imports the loop, launching, observing or commands.
"""
