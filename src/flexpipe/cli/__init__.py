"""The ``flexpipe`` command line: a thin layer that parses arguments, calls the public API and
renders the result. ``main.py`` holds the one table of subcommands; each ``cmd_<name>.py`` exposes
``register(sub)`` and ``run(args)``; ``common.py`` the options and loading steps they share."""
