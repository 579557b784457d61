"""Many ranks and many nodes: torchrun's command line (``torchrun``), the ranks' error files and
the root cause (``errorfiles``), and the one decision shared by every node (``coordination``).

oomguard starts ranks only through torchrun and rendezvous only through c10d; what it adds is that
one classification of a failure drives the next plan for every rank on every node.
"""
