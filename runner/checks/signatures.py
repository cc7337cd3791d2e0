"""Each component's settings against its constructor's signature: unknown keys, and values of the wrong simple type.

CLI → compose → [validate: these checks, after the plain values] → run folder → launch → worker → build → loop →
teardown. Binding, not building: it costs microseconds and imports nothing beyond the targets' modules. Hydra's
`+key` adds keys past any schema, so this is what finds `+strategy.timeot=5` or `+model.widht=8`. The keys an option
file left when the config changed its `_target_` (an experiment without `- override /model: null`) are one line.
"""
from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from runner.build import STRATEGY_COMPONENTS
from runner.plan import Plan
from runner.values import show, suggest

_EMPTY = inspect.Parameter.empty
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def parameters(target: Any) -> Optional[dict[str, inspect.Parameter]]:
    """The target's parameters with evaluated annotations where they evaluate; None without a signature."""
    try:
        signature = inspect.signature(target, eval_str=True)
    except (NameError, TypeError, SyntaxError, AttributeError):  # an annotation only a type checker sees
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return None
    except ValueError:  # a builtin without a signature
        return None
    return dict(signature.parameters)


def _wrapper_takes_any(target: Any) -> bool:
    """Whether the function called is a wrapper that takes any keyword, whatever the signature it shows (it follows
    `__wrapped__`): HuggingFace's configs (transformers 5) show their dataclass fields and take any other key."""
    function = target.__init__ if inspect.isclass(target) else target
    code = getattr(function, "__code__", None)
    return hasattr(function, "__wrapped__") and code is not None and bool(code.co_flags & inspect.CO_VARKEYWORDS)


def check_settings(key: str, node: Any, leading: int = 0, injected: tuple[str, ...] = (),
                   kwargs_target: Any = None, kwargs_skip: tuple[str, ...] = ()) -> Iterator[str]:
    """Problems of the settings at `key` (a node with `_target_`) as arguments of that target.

    `leading`: positional arguments the runner passes first (an optimizer's parameters); `injected`: keyword
    arguments it passes itself. A target taking `**kwargs` accepts any other key, unless `kwargs_target` says
    where they go (DDPStrategy's go to DistributedDataParallel, less `kwargs_skip`).
    """
    target = get_method(node._target_)
    params = parameters(target)
    if params is None:
        return
    named = [p for p in params.values() if p.kind in _NAMED][leading:]
    allowed = {p.name: p for p in named if p.name not in injected}
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) or _wrapper_takes_any(target)
    if takes_kwargs and kwargs_target is not None:
        forwarded = parameters(kwargs_target) or {}
        allowed.update({n: p for n, p in forwarded.items()
                        if p.kind in _NAMED and n not in ("self", *kwargs_skip) and n not in allowed})
        takes_kwargs = False
    settings = [k for k in node if not str(k).startswith("_")]
    unknown = [str(k) for k in settings if k not in allowed] if not takes_kwargs else []
    left = _left_by_option(key, node, unknown)
    if left:
        yield _left_line(key, node._target_, *left)
    for name in settings:
        if name not in allowed:
            if name in unknown and not (left and name in left[1]):
                names = sorted(allowed)
                yield (f"{key}.{name} is not a setting of {key} ({node._target_}){suggest(str(name), names)}; "
                       f"allowed: {', '.join(names) if names else 'none'}")
            continue
        try:
            value = node[name]
        except InterpolationResolutionError as error:  # e.g. ${data.num_features} of data that has none
            raw = OmegaConf.to_container(node, resolve=False)[name]
            yield (f"{key}.{name}={raw} cannot be worked out: {str(error).splitlines()[0]}; set {key}.{name} "
                   "to a value")
            continue
        problem = _type_problem(allowed[name], value)
        if problem:
            yield f"{key}.{name}={show(node[name])} {problem} ({node._target_})"


def _left_by_option(group: str, node: Any, unknown: list[str]) -> Optional[tuple[str, list[str]]]:
    """The option whose file left its keys in `group` when the config changed its `_target_` (an experiment without
    `- override /group: null`, or `group._target_=...`), and those of `unknown` it left, when several: the chosen
    option where this process runs a Hydra job, else the one whose values the keys still have."""
    if "." in group or len(unknown) < 2:
        return None
    raw = OmegaConf.to_container(node, resolve=False)
    found = []
    for option, spec, chosen in _option_files(group):
        left = [k for k in unknown if k in spec]
        if spec.get("_target_") not in (None, node._target_) and len(left) > 1:
            found.append((not chosen, -sum(spec[k] == raw[k] for k in left), option, left))
    return min(found)[2:] if found else None


def _left_line(group: str, target: str, option: str, left: list[str]) -> str:
    """One line for the leftover keys, where each would be a line of its own naming none of the fix."""
    return (f"{group}._target_ is {target} but {group}={option}'s keys remain ({', '.join(left)}): add "
            f'"- override /{group}: null" to the experiment\'s defaults, or delete them with '
            + " ".join(f"~{group}.{k}" for k in left))


def _option_files(group: str) -> Iterator[tuple[str, dict, bool]]:
    """The options of `group` as plain data, and whether each is the chosen one (known where this process runs a
    Hydra job): the user's config folders' before the built-in ones. Read, never composed: this only names where
    keys came from."""
    from hydra.core.hydra_config import HydraConfig

    from runner.config import CONFIG_DIR

    folders, chosen = [], None
    if HydraConfig.initialized():
        runtime = HydraConfig.get().runtime
        chosen = runtime.choices.get(group)
        folders = [s.path for s in runtime.config_sources if s.schema == "file"]
    for folder in dict.fromkeys([*folders, CONFIG_DIR]):
        for path in sorted(Path(folder, group).glob("*.yaml")):
            try:
                spec = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError, UnicodeDecodeError):
                continue
            if isinstance(spec, dict):
                yield path.stem, spec, path.stem == chosen


def _type_problem(param: inspect.Parameter, value: Any) -> Optional[str]:
    """What is wrong with `value` for a parameter annotated (or defaulting to) bool, int, float, str or Literal."""
    expected = param.annotation if param.annotation is not _EMPTY else None
    if expected is None and isinstance(param.default, bool):  # an int default may still take a float
        expected = bool
    if expected is None or isinstance(expected, str):
        return None
    options = _options(expected)
    if options is None:
        return None
    if value is None:
        return None if (type(None) in options or param.default is None) else "must not be null"
    if any(_fits(value, option) for option in options):
        return None
    return f"must be {' or '.join(_name(o) for o in options if o is not type(None))}"


def _options(annotation: Any) -> Optional[list[Any]]:
    """The checkable alternatives of an annotation, or None when any part of it is beyond these checks."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        parts = [_options(a) for a in typing.get_args(annotation)]
        return None if any(p is None for p in parts) else [o for p in parts for o in p]
    if origin is typing.Literal:
        return [("literal", typing.get_args(annotation))]
    if annotation in (bool, int, float, str, type(None)):
        return [annotation]
    return None


def _fits(value: Any, option: Any) -> bool:
    if isinstance(option, tuple):
        return value in option[1]
    if option is bool:
        return isinstance(value, bool)
    if option is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if option is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, option)


def _name(option: Any) -> str:
    if isinstance(option, tuple):
        return "one of " + ", ".join(map(str, option[1]))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[option]


def strategy_class(cfg: DictConfig) -> Any:
    """The class `strategy._target_` names, or None when it names a factory function."""
    target = get_method(cfg.strategy._target_)
    return target if inspect.isclass(target) else None


def check_signatures(plan: Plan) -> Iterator[str]:
    """Every group's keys against its target's constructor: `+strategy.timeot=5` fails here, by name."""
    from torch.nn.parallel import DistributedDataParallel

    from runner.strategies import DDPStrategy

    cfg = plan.cfg
    chosen = strategy_class(cfg)
    ddp = DistributedDataParallel if chosen and issubclass(chosen, DDPStrategy) else None
    # DDPStrategy passes its other keyword arguments to DistributedDataParallel; the module, the devices and
    # the process group are the strategy's own.
    yield from check_settings("strategy", _without_ddp_settings(cfg), injected=STRATEGY_COMPONENTS,
                              kwargs_target=ddp,
                              kwargs_skip=("module", "device_ids", "output_device", "process_group", "device_mesh"))
    yield from _ddp_settings_under_fsdp(cfg)
    for group in ("accelerator", "precision", "checkpoint_io", "cluster", "model", "data", "task"):
        yield from check_settings(group, cfg[group])
        yield from check_nested(group, cfg[group])
    for key, node in plan.optimizers.items():  # one, or several named (optimizer.<name>)
        yield from check_settings(key, node, leading=1)  # called with the model's parameters
        yield from check_nested(key, node)
    yield from check_settings("scheduler", cfg.scheduler, leading=1)  # called with the optimizer
    yield from check_nested("scheduler", cfg.scheduler)
    for name, spec in plan.loggers.items():
        yield from check_settings(f"logger.{name}", spec)


def check_nested(key: str, node: Any) -> Iterator[str]:
    """The settings of every `_target_` node inside `node` (`model.net`, `model.optimizer` with `_partial_: true`,
    a list of transforms), each against its own target's signature. Hydra builds them only with the model, and a
    `_partial_` one only where the user's code calls it (configure_optimizers): a typo would fail there, in every
    worker, or, caught by a broad `except`, not at all."""
    for inner_key, inner in _nested_targets(key, node):
        yield from check_settings(inner_key, inner)


def _nested_targets(key: str, node: Any) -> Iterator[tuple[str, DictConfig]]:
    """(key, node) of each node with a `_target_` below `node`, depth first; interpolations are left to the node
    they point to."""
    if OmegaConf.is_dict(node):
        children = [(str(k), node._get_node(k)) for k in node if not str(k).startswith("_") or k == "_args_"]
    elif OmegaConf.is_list(node):
        children = [(f"[{i}]", node._get_node(i)) for i in range(len(node))]
    else:
        return
    for name, child in children:
        if child is None or child._is_interpolation() or child._is_missing():
            continue
        inner_key = f"{key}{name}" if name.startswith("[") else f"{key}.{name}"
        if OmegaConf.is_dict(child) and "_target_" in child:
            yield inner_key, child
        yield from _nested_targets(inner_key, child)


def is_fsdp(cfg: DictConfig) -> bool:
    from runner.strategies import FSDPStrategy

    chosen = strategy_class(cfg)
    return bool(chosen and issubclass(chosen, FSDPStrategy))


def _ddp_only_keys(cfg: DictConfig) -> list[str]:
    """Keys of strategy=fsdp that are DistributedDataParallel's arguments (what strategy=ddp passes on)."""
    from torch.nn.parallel import DistributedDataParallel

    if not is_fsdp(cfg):
        return []
    own = parameters(get_method(cfg.strategy._target_)) or {}
    ddp = parameters(DistributedDataParallel) or {}
    return [str(k) for k in cfg.strategy if k not in own and k in ddp]


def _without_ddp_settings(cfg: DictConfig) -> DictConfig:
    keys = _ddp_only_keys(cfg)
    if not keys:
        return cfg.strategy
    node = OmegaConf.to_container(cfg.strategy, resolve=True)
    return OmegaConf.create({k: v for k, v in node.items() if k not in keys})


def _ddp_settings_under_fsdp(cfg: DictConfig) -> Iterator[str]:
    own = [p for p in (parameters(get_method(cfg.strategy._target_)) or {}) if p not in STRATEGY_COMPONENTS]
    for key in _ddp_only_keys(cfg):
        yield (f"strategy.{key}={cfg.strategy[key]} is a setting of DistributedDataParallel (strategy=ddp); "
               f"strategy=fsdp shards instead of replicating and takes: {', '.join(own)}")
