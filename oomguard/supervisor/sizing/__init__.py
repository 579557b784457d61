"""What memory a micro-batch needs (``memmodel``) and how memory moves over one attempt (``trend``).
Pure functions of the facts, like decide/: no I/O here.
"""
