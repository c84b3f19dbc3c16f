"""The model table (`hf_fastpath.integrations.models.MODELS`) against the installed Transformers and the test families:
every family the tests run has a row, and every name a row gives exists."""

from __future__ import annotations

import importlib

import pytest
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_fastpath.integrations.models import MODELS, facts_for
from models import BASE_FAMILIES, tiny_model

# model types that are not Transformers' own (old remote-code names of AWQ checkpoints)
LEGACY_MODEL_TYPES = {"RefinedWebModel"}


def test_every_tested_family_has_a_full_row():
    for family in BASE_FAMILIES:
        row = facts_for(tiny_model(family))
        assert row.causal_lm is not None, family


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_row_names_exist_in_transformers(model_type):
    row = MODELS[model_type]
    if model_type not in LEGACY_MODEL_TYPES:
        assert model_type in CONFIG_MAPPING, f"{model_type} is not a Transformers model type"
    if row.causal_lm:
        cls = getattr(transformers, row.causal_lm)
        assert cls.config_class.model_type == model_type
    if row.attention_class_table:
        module_name, _ = row.attention_class_table  # the table itself may be gone (then the interface is used)
        importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    if row.final_logit_softcap:
        assert hasattr(CONFIG_MAPPING[model_type](), row.final_logit_softcap)


@pytest.mark.parametrize("family", BASE_FAMILIES)
def test_row_module_names_exist_in_the_model(family):
    model = tiny_model(family)
    row = facts_for(model)
    modules = dict(model.named_modules())
    for parent, names in row.shared_input_projections:
        parents = [m for n, m in modules.items() if n.rsplit(".", 1)[-1] == parent]
        assert parents, (family, parent)
        assert all(hasattr(p, n) for p in parents for n in names), (family, parent, names)
    if row.awq_activation:
        act, before = row.awq_activation
        assert any(hasattr(m, act) and hasattr(m, before) for m in modules.values()), (family, row.awq_activation)
