"""The ``opsched`` commands, a module each (its ``run(args)`` returns what ``--json`` prints), and
:mod:`opsched.commands.common`, what they share. :mod:`opsched.cli` parses the command line and calls them."""
