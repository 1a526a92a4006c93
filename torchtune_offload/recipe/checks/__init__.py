"""What a recipe checks before it loads anything: every config key and value (``config``, with the
optimizer's rules in ``optimizer_rules``), the files the config names (``file_checks``), and whether
the run fits the machine (``fit``); ``preflight`` runs them together."""
