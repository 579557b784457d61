"""What the supervisor, the worker library and the probe share: the record protocol between them,
the texts of out-of-memory failures, batch arithmetic, and reading the environment and signal names.

Standard library only, and nothing else of oomguard: the probe loads it into every Python process of
the worker before torch, and the supervisor imports it without paying for torch.
"""
