"""The user's training command as a template: its placeholders, how it hands the script its
accumulation, and the ``--edit`` copies of its config files. The typed config (``config.py``) checks
it at start and the loop renders it for every attempt, so it sits below both."""
