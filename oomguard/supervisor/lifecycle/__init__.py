"""The values a run's life is told in, shared by the loop (``run/``) and what records it (``record/``,
``web/``): the run's states, how an attempt ended and why oomguard stopped its worker. They import
nothing above them, so neither side reaches up into the other."""
