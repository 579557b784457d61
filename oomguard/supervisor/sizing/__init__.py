"""What memory a micro-batch needs: the memory model over a run's attempts and its predictions
(``memmodel``), the bookkeeping that learns sizes within a run and across runs (``tuning``; the fit
store's SQLite is record/fitstore.py), and how memory moves over one attempt (``trend``). Pure
functions of the facts, like decide/: no I/O here.
"""
