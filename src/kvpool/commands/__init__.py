"""Subcommands of the ``kvpool`` command line, one module each."""
