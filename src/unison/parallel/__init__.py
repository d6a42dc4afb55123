"""Model wrappers, one module per parallel strategy; each is a plain function over a module."""
