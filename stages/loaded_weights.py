"""Only the weights it was given: a model a stage loads must take every weight of its folder and
lack none, at the shapes the folder holds them, or the stage stops before it trains (InvalidInput,
exit 2). transformers builds the model its config.json describes and starts any weight it did not
find from random numbers, saying so only in the log: a config.json of another model, a `model:`
path to a sibling folder or a checkpoint saved with other layer names would train from noise.

What loading found comes from transformers itself (stages/pretrained.py LoadReport, alike on every
supported version and under ZeRO-3); the weights it leaves out by design (its ignore patterns,
tied weights) are not counted.

One exception, declared by the loading call (stages/models.py): a model built as another class
than its folder was saved as (a reward model or critic from a causal LM, a causal LM from a reward
model whose embeddings are tied) takes a new head (`adds_head`, e.g. the reward model's `score`)
and leaves the folder's behind (`drops_head`). A folder saved as the class built has its head:
then nothing may be missing. LoRA adapters are added after loading, not loaded.
"""

from __future__ import annotations

import logging

from core.errors import InvalidInput

log = logging.getLogger("stages")

SHOWN = 3  # names shown of each kind


def problem(path: str, report, adds_head: str | None = None, drops_head: str | None = None) -> str | None:
    """What is wrong with the weights `report` (pretrained.LoadReport) says `path` gave; None when nothing."""
    # Without architectures in config.json the class it was saved as is unknown: the declared heads may differ.
    replaced = report.built_as is not None and report.built_as != report.saved_as
    new = [n for n in report.missing if replaced and _under(n, adds_head)]
    left = [n for n in report.unexpected if replaced and _under(n, drops_head)]
    missing = [n for n in report.missing if n not in new]
    unexpected = [n for n in report.unexpected if n not in left]
    shapes = [f"{name}: {saved} in the folder, {built} in the model" for name, saved, built in report.mismatched]
    found = []
    if missing:
        found.append(f"{_count(missing, 'of the model', 'is', 'are')} not in the folder ({_names(missing)})")
    if unexpected:
        found.append(f"{_count(unexpected, 'of the folder', 'has', 'have')} no place in the model "
                     f"({_names(unexpected)})")
    if shapes:
        found.append(f"{_count(shapes, '', 'has', 'have')} another shape in the folder ({_names(shapes, '; ')})")
    found += report.errors
    if not found:
        if new:
            log.info("%s: %s: its %s head starts new", path, _model(report, replaced), adds_head)
        return None
    return (f"model {path}: its weights are not the ones its config.json describes ({_model(report, replaced)}): "
            f"{'; '.join(found)}. Training would start from random numbers there. Check that config.json was saved "
            "with these weights (not another model's, not edited), that `model:` names the folder you meant, and "
            "that the weights were saved whole (save_pretrained); then run again")


def _model(report, replaced: bool) -> str:
    """'LlamaForCausalLM; model_type llama', with the class the folder was saved as where another was built."""
    built = report.built_as or report.saved_as
    saved = f" from a folder saved as {report.saved_as}" if replaced and report.saved_as else ""
    return f"{built}{saved}; model_type {report.model_type}" if built else f"model_type {report.model_type}"


def refuse_unless_given(path: str, report, adds_head: str | None = None, drops_head: str | None = None) -> None:
    """InvalidInput on every rank when the weights of `path` are not all and only the model's on any
    rank (under ZeRO-3 only rank 0 reads the weights' values, and sees a shape differ)."""
    found = _on_any_rank(problem(path, report, adds_head, drops_head))
    if found:
        raise InvalidInput(found)


def _on_any_rank(found: str | None) -> str | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return found
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, found)
    return next((f for f in every if f), None)


def _under(name: str, module: str | None) -> bool:
    return module is not None and (name == module or name.startswith(module + "."))


def _count(names: list[str], whose: str, one: str, many: str) -> str:
    """'1 weight of the folder has', '3 weights of the folder have'."""
    return " ".join(filter(None, [f"{len(names)} weight{'' if len(names) == 1 else 's'}", whose,
                                  one if len(names) == 1 else many]))


def _names(names: list[str], sep: str = ", ") -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return sep.join(names[:SHOWN]) + more
