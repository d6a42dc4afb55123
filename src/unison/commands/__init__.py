"""The `unison` command line: thin parsers that call library code (launcher, environment report)."""
