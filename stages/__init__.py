"""What runs on the compute nodes: one file per stage kind plus the shared engine.

Importing this package (or `stages.runner`) must not import torch: the
submitting side pickles `stages.runner.StageJob` on a login node.
"""
