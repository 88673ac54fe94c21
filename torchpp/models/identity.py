"""Which model a plan trains: the plan's own (a preset, or the local directory it remembers), or
``--model`` when it names the same model.

A plan priced for one model and run on another trains something the plan never measured, with
stage boundaries, memory and times that no longer hold, so a different model is refused by name
before any rank reaches a collective. A local directory is the same model when its config.json
says the same (``presets.config_hash``), wherever it is: hosts keep their copies at different paths.
"""
from __future__ import annotations

from pathlib import Path

from ..formats import FormatError, ModelInfo
from .presets import ModelSpecError, config_hash, is_preset, resolve_model


def plan_model(info: ModelInfo, source: str, explicit: str | None = None) -> str:
    """The model (preset name or directory) to build for the plan ``source`` whose model is
    ``info``; ``explicit``: ``--model``. FormatError or ModelSpecError (one line) otherwise."""
    if explicit is not None:
        model = resolve_model(explicit)
    elif info.source == "preset":
        model = info.name
    elif not info.path:
        raise FormatError(source, "model.path", "a local checkpoint directory (the plan predates plans that "
                          f"remember it: pass --model PATH to the {info.name} directory)")
    elif not Path(info.path).is_dir():
        raise FormatError(source, "model.path", f"the {info.name} checkpoint directory, present on this host "
                          "(or pass --model PATH to its copy here)", info.path)
    else:
        model = info.path
    check_same_model(info, source, model, explicit)
    return model


def check_same_model(info: ModelInfo, source: str, model: str, explicit: str | None) -> None:
    """``model`` is the plan's: the same preset, or a directory with the plan's config hash (older
    plans without one: the dimensions ``torchpp.train`` checks next decide)."""
    given = f"--model {explicit}" if explicit is not None else f"model.path {model}"
    plan_says = f"the plan's model {info.name}" + (f" ({info.path}, config {info.config_hash})" if info.config_hash
                                                   else "")
    if is_preset(model):
        if model != info.name or info.source != "preset":
            raise ModelSpecError(f"{given}: expected {plan_says} ({source}), got preset {model}; plan for it or "
                                 "give the plan's model")
        return
    if info.config_hash and Path(model).is_dir():
        got = config_hash(model)
        if got != info.config_hash:
            raise ModelSpecError(f"{given}: expected {plan_says} ({source}), got {Path(model).name} (config {got}); "
                                 "plan for it or give the plan's model")
