"""The shipped stage kinds' schemas and declarations, one module per kind (sft, rm, dpo, ppo), torch-free;
each names its run in stages/. core/kinds.py imports this package the first time a kind is asked for,
as it would a plug-in's module. The pipeline file's shared parts (cluster, defaults, a stage's common
fields) are core/config.py's; an RL kind's `reward:` section is reward.py's."""

# Each declares its kind on import, in the order `validate` and the docs list the kinds.
from core.schemas import sft, rm, dpo, ppo  # noqa: F401, I001
