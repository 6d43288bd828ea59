"""The torch-free base under both `pipeline` (the orchestrator) and `stages` (what runs on the
nodes): the pipeline file's schema, a stage's task, the run folder's names, failures and the
run's timeline, metrics records, and the rules both sides compute the same way (rows, model
shapes, FLOPs, hardware, DeepSpeed settings, batch packing, reward functions, the built-in tiny
model and data). Imports nothing from `pipeline` or `stages`, and no torch at module level.
"""
