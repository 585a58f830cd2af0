"""The commands of ``vit-launch``, one module each. A command module holds ``SUMMARY`` (its line in
``vit-launch --help``), ``DESCRIPTION`` (the start of its own ``--help``), ``add_arguments(parser)``,
``check_arguments(args)`` (the values alone, before any file is read or process started) and
``command(args)``, which returns the exit code. Mistakes are raised (``LaunchError``,
``ConfigError``), never printed here: ``launch/cli.py`` lists the commands and reports them."""
