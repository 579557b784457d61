"""Many ranks and many nodes: the launchers' command lines (``torchrun``, ``accelerate``), each
attempt's argv and the ranks' root cause (``launcher``), and the one decision shared by every node
and its plan for another world (``coordination``).

oomguard starts ranks only through torchrun and rendezvous only through c10d; what it adds is that
one classification of a failure drives the next plan for every rank on every node.
"""
