"""Loading a RunConfig: YAML files, ``--set a.b=c`` overrides, readable errors.

The schema itself (``RunConfig`` and the run-level sections) is ``tasks.config``;
this module owns what comes from the user: files and overrides, and the rule
that overrides cannot name code to run.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rollout.config import RolloutConfig
from rollout.rewards import BUILTIN_REWARDS
from tasks.config import ConfigError, FaultSpec, RunConfig

__all__ = ["ConfigError", "FaultSpec", "RunConfig", "load_config", "parse_override"]


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {key!r} is not a section")
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=c`` -> ("a.b", c) with c parsed as YAML (numbers, bools, null, lists)."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set run.iterations=5")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"  unknown key {loc!r}: remove it or check its spelling")
        else:
            lines.append(f"  {loc or '<root>'}: {e['msg']}")
    return "\n".join(lines)


def _rollout_value(data: dict[str, Any], key: str) -> Any:
    section = data.get("rollout")
    default = RolloutConfig.model_fields[key].get_default(call_default_factory=True)
    return section.get(key, default) if isinstance(section, dict) else default


def _api_key_env(data: dict[str, Any]) -> Any:
    section = data.get("rollout")
    remote = section.get("remote_reward") if isinstance(section, dict) else None
    return remote.get("api_key_env") if isinstance(remote, dict) else None


# What an SGLang server runs: its command, the folders its imports come from, and
# flags that load code (--custom-weight-loader ...).
SGLANG_CODE_KEYS = ("launch_command", "pythonpath", "extra_args")


def _sglang_value(data: dict[str, Any], key: str) -> Any:
    engines = data.get("engines")
    sglang = engines.get("sglang") if isinstance(engines, dict) else None
    return sglang.get(key) if isinstance(sglang, dict) else None


def _check_code_unchanged(from_file: dict[str, Any], data: dict[str, Any]) -> None:
    """Overrides (``--set``, a deployment's ``overrides``) may not choose code to
    run: whoever can start a deployment can set them, while the config file is
    the operator's. So they cannot widen the trusted modules, nor name a reward
    outside the builtins that the file does not already name, nor choose which
    environment variable's secret is sent to the reward server, nor what an SGLang
    server runs (``SGLANG_CODE_KEYS``)."""
    for key in SGLANG_CODE_KEYS:
        if _sglang_value(data, key) != _sglang_value(from_file, key):
            raise ConfigError(
                f"overrides cannot change engines.sglang.{key}: what the SGLang server runs "
                "(its command, import folders and flags) is chosen in the config file; put it there"
            )
    if _api_key_env(data) != _api_key_env(from_file):
        raise ConfigError(
            "overrides cannot change rollout.remote_reward.api_key_env: which secret of the "
            "environment is sent to a reward server is chosen in the config file; put it there"
        )
    if _rollout_value(data, "trusted_reward_modules") != _rollout_value(
        from_file, "trusted_reward_modules"
    ):
        raise ConfigError(
            "overrides cannot change rollout.trusted_reward_modules: which code a run may import is "
            "chosen in the config file; put it in the config file"
        )
    reward = _rollout_value(data, "reward")
    # A name without ':' is no code; the rollout section explains a typo there.
    named_code = isinstance(reward, str) and ":" in reward
    if named_code and reward != _rollout_value(from_file, "reward"):
        raise ConfigError(
            f"overrides cannot set rollout.reward to {reward!r}: only a builtin "
            f"({', '.join(BUILTIN_REWARDS)}) or the reward the config file names; "
            "put it in the config file (with its module under rollout.trusted_reward_modules)"
        )


def load_config(
    path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> RunConfig:
    """Load a RunConfig from YAML (or defaults) and apply overrides."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {str(p)!r} does not exist; pass a YAML file such as configs/tiny-cpu.yaml"
            )
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections at the top")
        source = str(p)
    items = list(
        overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or [])
    )
    from_file = copy.deepcopy(data)
    for key, value in items:
        _set_dotted(data, key, value)
    if items:
        _check_code_unchanged(from_file, data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None
