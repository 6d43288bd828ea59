"""The orchestrator: pipeline file schema, stage graph, submission and run state.

Imports no torch, DeepSpeed or transformers at module level: `validate`,
`plan` and `status` run on login nodes without GPU libraries.
"""
