"""Real config.json files -> the transformers config and the class `neuronlocal check` runs.

What AutoModelForCausalLM would do, said out loud: the class comes from `architectures`
when transformers has it, else from the model type's auto mapping (and the report says
which). Model types match case-insensitively. Remote-code configs (`auto_map`) run only
with `--trust-remote-code` from a local directory holding the code. A config that fails
transformers' validation is repaired where the fix is unambiguous (with a warning naming
the field), else rejected naming the field. Every rejection is a `BadInput` (exit 2).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from neuronlocal.core.files import load_input_json
from neuronlocal.estimate.workload import size_problem

# Task -> the auto mapping AutoModelFor<Task> uses.
TASK_MAPPINGS = {
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "image-classification": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                             "AutoModelForImageClassification"),
}
_ARCH_SUFFIXES = {
    "causal-lm": ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"),
    "seq2seq": ("ForConditionalGeneration", "ForSeq2SeqLM"),
    "masked-lm": ("ForMaskedLM",),
    "image-classification": ("ForImageClassification", "ForImageClassificationWithTeacher"),
}
_REPAIR_TRIES = 8
MAX_CONFIG_BYTES = 4 * 2**20  # a config.json is a few KiB


class BadInput(ValueError):
    """The config, model type or options cannot be used (exit status 2)."""


@dataclass
class Loaded:
    """A config ready to check, the class to build, and what was decided on the way."""

    config: Any
    model_cls: Any
    architecture: str
    how: str  # which rule picked the class, for the report
    notes: list[str] = field(default_factory=list)  # repairs and other warnings


def default_config_path() -> Path:
    return Path(str(resources.files("neuronlocal.support") / "default_config.json"))


def read_json(path: Path) -> dict[str, Any]:
    try:
        raw = load_input_json(path, MAX_CONFIG_BYTES, "a model's config.json")
    except ValueError as e:
        raise BadInput(f"{e}.") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: a config.json holds one JSON object, this one holds a "
                       f"{type(raw).__name__}. Pass the model's config.json.")
    return raw


def model_type_of(raw: dict[str, Any], where: str) -> tuple[str | None, str | None]:
    """(transformers model type, note): exact match first, then case-insensitive."""
    from transformers import CONFIG_MAPPING

    mt = raw.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise BadInput(f"{where}: no 'model_type' field; a transformers config.json names its "
                       "model type, e.g. \"model_type\": \"llama\".")
    if mt in CONFIG_MAPPING:
        return mt, None
    lower = {k.lower(): k for k in CONFIG_MAPPING}
    if mt.lower() in lower:
        known = lower[mt.lower()]
        return known, f"model_type {mt!r} matched transformers' {known!r} (case-insensitive)"
    return None, None


def _find_fields(tree: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """Every dict level of a config tree that holds `name`."""
    out = [tree] if name in tree else []
    for value in tree.values():
        if isinstance(value, dict):
            out += _find_fields(value, name)
    return out


def _levels(cls: Any, d: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The dict levels holding `name`, or where the class (or a sub-config) declares it."""
    import dataclasses

    found = _find_fields(d, name)
    if found:
        return found
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return [d]
    levels = []
    for k in getattr(cls, "sub_configs", None) or {}:
        if d.get(k) is None:
            d[k] = {}
        if isinstance(d[k], dict):
            levels.append(d[k])
    return levels


def _repair(cls: Any, d: dict[str, Any], err: Exception) -> str | None:
    """Fix `d` in place for an unambiguous validation error; the warning, or None."""
    msg = str(err)
    typed = re.search(r"Field '([\w.]+)' expected (\w+), got (\w+) \(value: (.*)\)", msg)
    if typed:
        name, want, _, _ = typed.groups()
        fixed = []
        for level in _find_fields(d, name):
            value = level[name]
            if want == "bool" and isinstance(value, (int, float)) and not isinstance(value, bool):
                level[name] = bool(value)
            elif want == "int" and isinstance(value, float) and value.is_integer():
                level[name] = int(value)
            elif want == "float" and isinstance(value, int) and not isinstance(value, bool):
                level[name] = float(value)
            else:
                continue
            fixed.append(f"'{name}': {value!r} is not a {want}; using {level[name]!r} "
                         f"(the value it had when transformers read it as a {want})")
        return fixed[0] if fixed else None
    must = re.search(r"\b(\w+) must be (-?\d+|True|False|None), got (\S+)", msg)
    if must:
        name, want = must.group(1), must.group(2)
        value = {"True": True, "False": False, "None": None}.get(want, None)
        value = int(want) if want.lstrip("-").isdigit() else value
        levels = _levels(cls, d, name)
        for level in levels:
            level[name] = value
        if levels:
            return f"'{name}' must be {want} for this architecture; using {want}"
    return None


def _failing_field(err: Exception) -> str:
    msg = str(err)
    m = re.search(r"field '([\w.]+)'", msg) or re.search(r"validator '([\w.]+)'", msg)
    detail = msg.strip().splitlines()[-1].strip()
    return f"{m.group(1)}: {detail}" if m else detail


def build_config(cls: Any, d: dict[str, Any]) -> tuple[Any, list[str]]:
    """`cls.from_dict(d)`, repairing unambiguous validation errors; (config, warnings)."""
    from huggingface_hub.errors import StrictDataclassError

    d = copy.deepcopy(d)  # private copy: repairs edit it
    notes: list[str] = []
    for _ in range(_REPAIR_TRIES):
        try:
            return cls.from_dict(d), notes
        except StrictDataclassError as e:
            note = _repair(cls, d, e)
            if note is None:
                raise BadInput("the config fails transformers' validation, field "
                               f"{_failing_field(e)}; fix that field in config.json.") from e
            notes.append(note)
    raise BadInput("the config keeps failing transformers' validation after repairs: "
                   + "; ".join(notes))


def _mapping(task: str) -> dict[str, Any]:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, TASK_MAPPINGS[task][0])


def _class_for_type(model_type: str, task: str) -> str | None:
    names = _mapping(task).get(model_type)
    if isinstance(names, (list, tuple)):
        return names[0] if names else None
    return names


def config_for_class(cfg: Any, model_cls: Any) -> Any:
    """The config `model_cls` takes: `cfg`, or its sub-config of the class's config type."""
    want = getattr(model_cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return cfg
    for value in vars(cfg).values():
        if isinstance(value, want):
            return value
    return cfg


def pick_architecture(cfg: Any, raw_archs: list[str] | None, task: str
                      ) -> tuple[str, Any, str]:
    """(class name, class, how it was chosen), as AutoModelFor<task> would choose."""
    import transformers

    auto = TASK_MAPPINGS[task][1]
    task_classes = {n for v in _mapping(task).values()
                    for n in (v if isinstance(v, (list, tuple)) else [v])}
    for arch in raw_archs or []:
        if (isinstance(arch, str) and hasattr(transformers, arch)
                and (arch in task_classes or arch.endswith(_ARCH_SUFFIXES[task]))):
            return arch, getattr(transformers, arch), "from config.json's 'architectures'"
    found = _class_for_type(cfg.model_type, task)
    if found is None:
        raise BadInput(f"model type {cfg.model_type!r} has no {auto} class in transformers "
                       f"{transformers.__version__}; try another --task.")
    named = [a for a in raw_archs or [] if isinstance(a, str)]
    how = (f"{auto}'s class for model type {cfg.model_type!r}"
           + (f" ('architectures' names {', '.join(named)}: not a {task} class of transformers)"
              if named else ""))
    return found, getattr(transformers, found), how


def _remote_code(raw: dict[str, Any], where: str, model_dir: str | None, trust: bool,
                 task: str) -> Loaded:
    """A config whose model type only remote code defines: run that code, or say how."""
    auto = TASK_MAPPINGS[task][1]
    auto_map = raw.get("auto_map") or {}
    ref = auto_map.get(auto) or next(iter(auto_map.values()), "")
    ref = ref[0] if isinstance(ref, list) else str(ref)
    files = sorted({str(v if isinstance(v, str) else v[0]).split("--")[-1].rsplit(".", 1)[0]
                    + ".py" for v in auto_map.values() if v})
    mt = raw.get("model_type")
    if not trust or not model_dir:
        raise BadInput(
            f"{where}: model type {mt!r} is defined by remote code (auto_map -> {ref}), not by "
            f"transformers. Run `neuronlocal check --model-dir DIR --trust-remote-code` with "
            f"DIR holding config.json and {', '.join(files) or 'the code auto_map names'} "
            "(only if you trust that code: it runs in this process).")
    missing = [f for f in files if not (Path(model_dir) / f).is_file()]
    if missing:
        raise BadInput(f"{model_dir}: auto_map needs {', '.join(missing)} next to config.json; "
                       "copy the model's code files there (nothing is downloaded).")
    if auto not in auto_map:
        raise BadInput(f"{where}: auto_map has no {auto} entry, so this remote code defines no "
                       f"{task} model; auto_map has {', '.join(auto_map)}.")
    import transformers

    try:
        cfg = transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=True,
                                                      local_files_only=True)
        model_cls = transformers.dynamic_module_utils.get_class_from_dynamic_module(
            ref, model_dir, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - user code can raise anything
        raise BadInput(f"{model_dir}: loading the remote code failed: "
                       f"{type(e).__name__}: {e}") from e
    return Loaded(cfg, model_cls, model_cls.__name__, f"remote code {ref} (--trust-remote-code)")


def load(config: str | None = None, model_dir: str | None = None, model_type: str | None = None,
         trust_remote_code: bool = False, task: str = "causal-lm") -> Loaded:
    """The config to check and its class; see the module docstring."""
    from transformers import CONFIG_MAPPING

    if task not in TASK_MAPPINGS:
        raise BadInput(f"unknown task {task!r}; choose one of {', '.join(TASK_MAPPINGS)}.")
    notes: list[str] = []
    if model_type:
        mt = model_type if model_type in CONFIG_MAPPING else {
            k.lower(): k for k in CONFIG_MAPPING}.get(model_type.lower())
        if mt is None:
            raise BadInput(f"unknown model type {model_type!r}; `python -c \"import transformers;"
                           " print(sorted(transformers.CONFIG_MAPPING))\"` lists the known ones.")
        raw: dict[str, Any] = {"model_type": mt}
        where = f"model type {mt!r}"
    else:
        if model_dir:
            d = Path(model_dir)
            if not d.is_dir():
                raise BadInput(f"--model-dir {model_dir}: no such directory (give a local "
                               "directory holding config.json; nothing is downloaded).")
            path = d / "config.json"
            if not path.is_file():
                raise BadInput(f"--model-dir {model_dir}: the directory has no config.json "
                               "(save_pretrained writes one).")
        else:
            path = Path(config) if config else default_config_path()
        raw, where = read_json(path), str(path)
        mt, note = model_type_of(raw, where)
        if raw.get("auto_map") and (mt is None or mt != raw.get("model_type")):
            return _remote_code(raw, where, model_dir, trust_remote_code, task)
        if mt is None:
            raise BadInput(f"{where}: model_type {raw.get('model_type')!r} is not a model type "
                           "of transformers (and config.json has no auto_map pointing to code "
                           "that defines it).")
        if note:
            notes.append(note)
        if raw.get("auto_map"):
            notes.append(f"auto_map's remote code not used: transformers has model type {mt!r} "
                         "built in (what AutoModel does without trust_remote_code)")
        raw = {**raw, "model_type": mt}
    problem = size_problem(raw, where)
    if problem:
        raise BadInput(problem)
    try:
        cfg, repairs = build_config(CONFIG_MAPPING[mt], raw if not model_type else {})
    except BadInput as e:
        raise BadInput(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - transformers' config code can raise anything
        raise BadInput(f"{where}: transformers cannot build this config "
                       f"({type(e).__name__}: {e}); fix config.json.") from None
    notes += repairs
    arch, model_cls, how = pick_architecture(cfg, raw.get("architectures"), task)
    return Loaded(config_for_class(cfg, model_cls), model_cls, arch, how, notes)
