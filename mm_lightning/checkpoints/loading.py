"""Checkpoints are data: the parts a checkpoint records (``class_path`` + ``init_args``) are rebuilt only as the
kind of object their slot takes, and ``DualEncoder.from_checkpoint`` rebuilds the network of a training checkpoint.

Every loader goes through :func:`checked_hyperparameters` before anything a checkpoint names is called:
``DualEncoder.from_checkpoint`` (and ``export``, ``zeroshot``), ``MultimodalModule.load_from_checkpoint`` and the
commands' ``--ckpt_path``. The trust boundary (docs/models.md): a checkpoint can name only classes of the kind
their slot takes (``torch.nn.Module`` for a tower or the loss, the rule's base class for a training rule such as
``param_groups``) importable on your machine, and importing a class's module runs that module's top level; functions it
names must be torch's; it cannot switch on ``trust_remote_code``.
"""

from __future__ import annotations

import importlib
import inspect
import io
import os
import zipfile
from collections.abc import Container, Iterator, Mapping
from typing import Any

import torch
from jsonargparse import ArgumentParser, Namespace
from lightning.pytorch import LightningModule
from lightning.pytorch.core.saving import (
    CHECKPOINT_PAST_HPARAMS_KEYS,
    load_hparams_from_tags_csv,
    load_hparams_from_yaml,
)
from torch import nn

from mm_lightning import ExplainedError
from mm_lightning.checkpoints.sharded import checked_meta, is_sharded_checkpoint, read_sharded_checkpoint
from mm_lightning.models.config import CHECKPOINT_PREFIX, DEFAULT_FUSION, DEFAULT_TRAINING, PARTS
from mm_lightning.models.rules import RULES, TowerAdapters

# the instantiator LightningCLI records for a module it built; Lightning calls a checkpoint's instantiator
CLI_INSTANTIATORS = ("lightning.pytorch.cli.instantiate_module", "pytorch_lightning.cli.instantiate_module")
# MultimodalModule's option groups: plain data (a string there would be read as YAML)
OPTION_GROUPS = ("image", "text", "fusion", "objective", "optim")
# where a function a part takes (an activation, say) may come from
TENSOR_FUNCTIONS = (torch, torch.nn.functional, torch.special, torch.linalg, torch.fft)


class UnsafeCheckpointError(ExplainedError, ValueError):
    """A checkpoint names something its slot does not take; nothing it names was called. One line: the
    checkpoint, the key, what it named and why."""


def checked_hyperparameters(
    hparams: Mapping[str, Any] | None,
    source: str,
    given: Container[str] = (),
    remote_code_allowed: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Namespace]:
    """Checks a checkpoint's ``hyper_parameters``; returns each recorded part parsed against its slot (not built).

    Args:
        hparams: the checkpoint's ``hyper_parameters`` (None: nothing recorded).
        source: the checkpoint, as the messages name it.
        given: parts the caller passes itself (their records are not used, so not checked).
        remote_code_allowed: parts the user's own config lets run their model's code (``trust_remote_code:
            true``), by name: the recorded part may do so only if it names the same class and ``name``.

    Raises:
        UnsafeCheckpointError: anything recorded that is not of the kind its slot takes."""
    hparams = dict(hparams or {})

    def refuse(key: str, why: str) -> UnsafeCheckpointError:
        key = key.encode("unicode_escape").decode()  # a key with a line break stays on the line
        return UnsafeCheckpointError(f"{source}: hyper_parameters.{key} {why}; nothing it names was run")

    instantiator = hparams.get("_instantiator")
    if instantiator is not None and instantiator not in CLI_INSTANTIATORS:
        raise refuse("_instantiator", f"names {instantiator!r}, not LightningCLI's instantiator")
    if "_class_path" in hparams:
        raise refuse(
            "_class_path", f"names {hparams['_class_path']!r}: this project's modules record no class"
        )
    parsed = {}
    for name, value in hparams.items():
        name = str(name)
        if name in (*PARTS, *RULES) and value is not None:
            if not (isinstance(value, Mapping) and isinstance(value.get("class_path"), str)):
                # a string is read as YAML, a record without class_path merges into the configured part
                raise refuse(name, "is not a record of a class (class_path + init_args)")
            if name not in given:
                user_part = (remote_code_allowed or {}).get(name)
                parsed[name] = _checked_part(name, value, refuse, user_part)
            continue
        if name in OPTION_GROUPS and not (value is None or isinstance(value, Mapping)):
            raise refuse(name, f"is a {type(value).__name__}, not a group of options")
        for key, nested in _walk(value, name):
            if isinstance(nested, Mapping) and "class_path" in nested:
                raise refuse(key, f"names the class {nested['class_path']!r} where options are plain data")
    return parsed


def slot_type(name: str) -> type:
    """The type a part's or rule's slot takes: a part (tower, pair loss) is an ``nn.Module``, a rule its base class."""
    return nn.Module if name in PARTS else RULES[name]


def _checked_part(
    name: str, spec: Mapping[str, Any], refuse: Any, user_part: Mapping[str, Any] | None
) -> Namespace:
    """A part's or rule's record parsed against its slot (:func:`slot_type`)."""
    class_path = spec["class_path"]
    cls, kind = _import_class(class_path), slot_type(name)
    if not (isinstance(cls, type) and issubclass(cls, kind)):
        kind_name = "torch.nn.Module" if kind is nn.Module else f"{kind.__module__}.{kind.__qualname__}"
        what = "does not exist or cannot be imported" if cls is None else f"is not a {kind_name} subclass"
        raise refuse(f"{name}.class_path", f"names {class_path!r}, which {what}")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--part", type=kind)
    try:
        # jsonargparse checks init_args against the class's signature, and typed nested classes against theirs
        parsed = parser.parse_object({"part": dict(spec)}).part
    except Exception as err:  # noqa: BLE001 (jsonargparse raises several kinds for a spec that does not fit)
        raise refuse(name, f"does not fit {class_path}'s arguments: {' '.join(str(err).split())}") from None
    recorded_name = (spec.get("init_args") or {}).get("name")
    same_model = user_part is not None and user_part.get("class_path") == parsed.class_path
    same_model = same_model and (user_part.get("init_args") or {}).get("name") == recorded_name
    defaults = {n: p.default for n, p in inspect.signature(cls).parameters.items()}
    arguments = [
        (f"{name}.init_args.{k}", v)
        for k, v in vars(parsed.get("init_args") or Namespace()).items()
        if not (k in defaults and v is defaults[k])
    ]  # the class's own defaults: not the record's
    arguments.append((f"{name}.dict_kwargs", parsed.get("dict_kwargs")))
    for key, value in (pair for argument in arguments for pair in _walk(argument[1], argument[0])):
        if key.rpartition(".")[2] in getattr(cls, "importing_options", ()):
            raise refuse(key, f"names a module for {cls.__name__} to import")
        _check_nested(key, value, refuse)
        if key.endswith(".trust_remote_code") and value is True and not same_model:
            raise refuse(
                key,
                "is true: only your own config can let a model run code it ships (the same tower with"
                " trust_remote_code: true there), or build the tower in Python and pass it",
            )
    return parsed


def _check_nested(key: str, value: Any, refuse: Any) -> None:
    """What the parser resolved inside a part's arguments: classes must be modules, functions torch's."""
    if isinstance(value, Namespace) and "class_path" in value:
        nested = _import_class(value.class_path)
        if not (isinstance(nested, type) and issubclass(nested, nn.Module)):
            raise refuse(key, f"names {value.class_path!r}, which is not a torch.nn.Module subclass")
    elif isinstance(value, Mapping) and "class_path" in value:
        raise refuse(key, f"names the class {value['class_path']!r} in a plain dict option")
    elif isinstance(value, type):
        if not issubclass(value, nn.Module):
            raise refuse(
                key, f"names {value.__module__}.{value.__qualname__}, which is not a torch.nn.Module subclass"
            )
    elif callable(value) and not any(
        getattr(m, getattr(value, "__name__", ""), None) is value for m in TENSOR_FUNCTIONS
    ):
        what = getattr(value, "__qualname__", type(value).__qualname__)
        raise refuse(
            key, f"names {getattr(value, '__module__', '')}.{what}, not one of torch's tensor functions"
        )


def _walk(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    """Every value under ``value`` (itself first) with its dotted key."""
    yield key, value
    if isinstance(value, Namespace):
        value = value.__dict__
    if isinstance(value, Mapping):
        for name, nested in value.items():
            yield from _walk(nested, f"{key}.{name}")
    elif isinstance(value, (list, tuple)):
        for i, nested in enumerate(value):
            yield from _walk(nested, f"{key}.{i}")


def _import_class(path: str) -> Any:
    """The object an import path names (its module imported, which runs its top level), or None."""
    module_name, _, attribute = path.rpartition(".")
    if not module_name:
        return None
    try:
        return getattr(importlib.import_module(module_name), attribute, None)
    except Exception:  # noqa: BLE001 (a module may raise anything while it is imported)
        return None


def built_rule(name: str, record: Mapping[str, Any]) -> Any:
    """The rule a record names (``class_path`` + ``init_args``), built as its slot's type: a module built in Python
    records its rules so, and Lightning passes the records back when it loads the module (checked before)."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--rule", type=RULES[name])
    return parser.instantiate(parser.parse_object({"rule": dict(record)})).rule


def build_parts(parsed: Mapping[str, Namespace]) -> dict[str, Any]:
    """The checked parts and rules (:func:`checked_hyperparameters`), built."""
    built = {}
    for name, spec in parsed.items():
        parser = ArgumentParser(exit_on_error=False)
        parser.add_argument("--part", type=slot_type(name))
        built[name] = parser.instantiate(Namespace(part=spec)).part
    return built


def checked_for_loading(
    cls: type,
    checkpoint_path: Any,
    map_location: Any = None,
    hparams_file: Any = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> Any:
    """The check of ``cls.load_from_checkpoint`` (same arguments): the hyperparameters Lightning would build it
    from (the checkpoint's, under its past keys too, or an ``hparams_file``'s), checked. Parts passed as
    arguments replace the recorded ones, so they are not checked.

    Returns what to load: the same local file or open file, or a remote checkpoint's bytes as read for the check,
    so that the file checked is the file loaded. With ``weights_only=False`` its user has chosen to trust the file
    (a pickle can run anything): nothing is checked, but a sharded folder is always read as data."""
    source = checkpoint_path
    if not hasattr(source, "read") and is_sharded_checkpoint(source):
        checkpoint = read_sharded_checkpoint(source)  # read as data (always), handed on as one file's bytes
        source = io.BytesIO()
        torch.save(checkpoint, source)
        source.seek(0)
    elif weights_only is False:
        return checkpoint_path
    elif hasattr(source, "read"):
        position = source.tell()
        try:
            checkpoint = torch.load(source, map_location="cpu", weights_only=True)
        finally:
            source.seek(position)
    elif os.path.isfile(source):  # memory-mapped: the weights are not read
        checkpoint = torch.load(
            source, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(source)
        )
    else:
        import fsspec

        with fsspec.open(source, "rb") as file:
            source = io.BytesIO(file.read())
        checkpoint = torch.load(source, map_location="cpu", weights_only=True)
        source.seek(0)
    if not isinstance(checkpoint, dict):
        return source  # Lightning says what it is
    hparams: dict[str, Any] = {}
    for key in CHECKPOINT_PAST_HPARAMS_KEYS:
        hparams.update(checkpoint.get(key) or {})
    if hparams_file is not None:
        extension = str(hparams_file).rsplit(".", 1)[-1].lower()
        if extension == "csv":
            hparams.update(load_hparams_from_tags_csv(hparams_file))
        elif extension in ("yml", "yaml"):
            hparams.update(load_hparams_from_yaml(hparams_file))
    else:
        hparams.update(checkpoint.get(LightningModule.CHECKPOINT_HYPER_PARAMS_KEY) or {})
    wrapped_in = checkpoint.get(LightningModule.CHECKPOINT_HYPER_PARAMS_NAME)
    if wrapped_in in inspect.signature(cls.__init__).parameters:  # Lightning passes them all as this argument
        hparams = {wrapped_in: hparams}
    checked_hyperparameters(hparams, str(checkpoint_path), set(kwargs) & {*PARTS, *RULES})
    return source


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """A checkpoint as data: a file with ``weights_only=True``, a sharded folder whole through its checked reader
    (:func:`~mm_lightning.checkpoints.sharded.read_sharded_checkpoint`)."""
    if is_sharded_checkpoint(path):
        return read_sharded_checkpoint(path)
    return torch.load(path, map_location=map_location, weights_only=True)


def checked_resume_file(path: str | os.PathLike, model: Mapping[str, Any]) -> dict[str, Any]:
    """A ``--ckpt_path`` checkpoint (a sharded one: its ``meta.pt``), loaded once its files and ``hyper_parameters``
    are checked; ``model`` is the
    user's own model config, which alone can let a tower run its model's code."""
    from mm_lightning.checkpoints.files import check_checkpoint_file

    content = checked_meta(path) if is_sharded_checkpoint(path) else check_checkpoint_file(path)
    allowed = {
        name: model[name] for name in PARTS
        if ((model.get(name) or {}).get("init_args") or {}).get("trust_remote_code") is True
    }  # fmt: skip
    checked_hyperparameters(content.get("hyper_parameters"), str(path), (), allowed)
    return content


def network_from_checkpoint(
    cls: type, path: str | os.PathLike, map_location: Any, parts: dict[str, Any]
) -> Any:
    """``cls`` (a ``DualEncoder``) built from the checkpoint's recorded parts, adapters and options, with its
    weights; the adapters merged into the towers."""
    unknown = sorted(set(parts) - {*PARTS, "adapters"})
    if unknown:
        raise TypeError(
            f"DualEncoder.from_checkpoint: unknown part(s) {unknown}; the parts: {[*PARTS, 'adapters']}"
        )
    checkpoint = read_checkpoint(path, map_location)
    hparams = checkpoint.get("hyper_parameters") or {}
    checked = checked_hyperparameters(hparams, str(path), given=parts)  # every record, as every loader does
    # the network's parts, and the adapters that change its towers (not the training rules)
    recorded = build_parts({name: spec for name, spec in checked.items() if name in (*PARTS, "adapters")})
    built = {}
    for name in PARTS:
        if name in parts:
            built[name] = parts[name]
        elif name in recorded:
            built[name] = recorded[name]
        elif name != "loss":
            raise ValueError(
                f"{path}: the checkpoint records no {name} (its module was built in Python); pass it: "
                f"DualEncoder.from_checkpoint(path, {name}=...)"
            )
    objective = hparams.get("objective") or {}
    model = cls(
        **built,
        image=hparams.get("image") or DEFAULT_TRAINING,
        text=hparams.get("text") or DEFAULT_TRAINING,
        embed_dim=hparams.get("embed_dim", 256),
        fusion=hparams.get("fusion") or DEFAULT_FUSION,
        itm=float(objective.get("itm_weight", 1.0)) > 0,
        adapters=parts.get("adapters") or recorded.get("adapters"),
    )
    state = {
        k[len(CHECKPOINT_PREFIX) :]: v
        for k, v in checkpoint["state_dict"].items()
        if k.startswith(CHECKPOINT_PREFIX)
    }
    model.load_state_dict(state)
    model.adapters.merge(model)  # plain towers with the adapted weights, as export and inference want them
    model.adapters = TowerAdapters()
    return model
