"""Accelerate 1.15's public surface, served under unison's module paths (core).

`inventory` is the generated list of every public name of `accelerate`, `accelerate.utils`, `.logging`,
`.local_sgd`, `.data_loader`, `.state` and `.big_modeling` (scripts/accelerate_public_names.py writes it);
`names` says what each one is in unison (unison's own object, a truthful probe, a constant, or a stand-in
that raises the migration guide's note when used) and gives each mirror module its PEP 562 `__getattr__`.
"""
