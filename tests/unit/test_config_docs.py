"""docs/configuration.md is generated from the config models, and stays so.

The page lists every key with its type, default and description; a key added
or changed without regenerating the page fails here, and so does a key
without a ``Field(description=...)``.
"""

from __future__ import annotations

from flows import config_docs


def test_configuration_page_matches_the_models():
    on_disk = config_docs.PAGE.read_text() if config_docs.PAGE.exists() else ""
    assert on_disk == config_docs.config_markdown(), (
        "docs/configuration.md is stale (the config models changed): run "
        "`python -m flows.config_docs` and commit the page"
    )


def test_check_flag_agrees_with_the_page():
    assert config_docs.main(["--check"]) == 0


def test_every_leaf_key_has_a_description():
    keys = list(config_docs.config_keys())
    missing = [k.key for k in keys if not k.description]
    assert not missing, (
        f"config keys without a description: {', '.join(missing)}; give each a "
        'Field(..., description="...") in the model that owns it'
    )


def test_nested_keys_are_dotted_and_literals_show_their_choices():
    keys = {k.key: k for k in config_docs.config_keys()}
    kind = keys["train.loss.rollout_correction.kind"]
    assert '"tis"' in kind.type and '"geo_mask"' in kind.type
    assert kind.default == "none"
    assert keys["rollout.top_p"].bounds == "> 0, <= 1"
    assert keys["tasks.retry_delay_s"].default == "[1.0, 2.0, 5.0]"  # default_factory, called
    assert keys["faults[].step"].default == "required"
    assert "storage" not in keys  # sections are headings, not keys
