"""The one registry behind every kind of extension (protocol/plugins.py): built-ins found
by name, third-party classes found through their distribution's entry points, unknown
names answered with a suggestion and the known names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from cloud.aggregation import AggregationStrategy, get_aggregation
from cloud.aggregation.modular import Modular
from cloud.assignment import AssignmentStrategy, get_assignment
from cloud.robust.config import DefenceConfig
from cloud.robust.rules import RobustAggregation, RobustRule, get_robust_rule
from cloud.strategies import Strategy, get_strategy
from cloud.strategy import ClientResult
from edge_sdk.objectives import ObjectiveTerm, check_objectives, terms_for
from moe_model.models import ModelAdapter, get_adapter
from protocol.messages import Objective, TrainConfig
from protocol.plugins import UnknownNameError

KINDS = [
    (Strategy, "fedmoe.strategies", "composed"),
    (AssignmentStrategy, "fedmoe.assignment", "fedmoe"),
    (AggregationStrategy, "fedmoe.aggregation", "modular"),
    (RobustRule, "fedmoe.robust_rules", "multi_krum"),
    (ModelAdapter, "fedmoe.model_families", "bert-upcycled"),
    (ObjectiveTerm, "fedmoe.objectives", "fedprox"),
]

RULE_MODULE = '''
import torch
from cloud.robust.rules import CoordinateRule


class ClippedMean(CoordinateRule):
    """Mean of the values clipped to [-bound, bound]; no name of its own: it takes its
    entry point's."""

    defaults = {"bound": 1.0}

    def combine(self, stacked):
        return stacked.clamp(-self.params["bound"], self.params["bound"]).mean(dim=0)


class NotARule:
    pass
'''

TERM_MODULE = '''
from edge_sdk.objectives import ObjectiveTerm


class FakeZero(ObjectiveTerm):
    name = "fake_zero"

    def __call__(self, model, batch, logits):
        return logits.new_zeros(())
'''

ENTRY_POINTS = '''
[fedmoe.robust_rules]
clipped_mean = fedmoe_fake_rule:ClippedMean
not_a_rule = fedmoe_fake_rule:NotARule

[fedmoe.objectives]
fake_zero = fedmoe_fake_terms
'''


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch):
    """A third-party distribution ``fedmoe-fake`` as pip would install it: two modules and
    a ``.dist-info`` directory with ``entry_points.txt``, on ``sys.path``. The registries
    are restored afterwards."""
    (tmp_path / "fedmoe_fake_rule.py").write_text(RULE_MODULE)
    (tmp_path / "fedmoe_fake_terms.py").write_text(TERM_MODULE)
    info = tmp_path / "fedmoe_fake-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedmoe-fake\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    for base in (RobustRule, ObjectiveTerm):
        base.registry.names()  # the built-ins imported first: one first imported during the test would
        # register only in the copy below and, its module then imported, never again (a later test
        # on the same worker found no 'fedprox')
        monkeypatch.setattr(base.registry, "_classes", dict(base.registry._classes))
        monkeypatch.setattr(base.registry, "_aliases", dict(base.registry._aliases))
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in ("fedmoe_fake_rule", "fedmoe_fake_terms"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    return tmp_path


@pytest.mark.parametrize("base,group,builtin", KINDS)
def test_every_kind_has_one_registry_with_its_entry_point_group(base, group, builtin):
    assert base.registry.group == group and base.registry.base is base
    assert builtin in base.registry.names() and base.lookup(builtin).name == builtin


def test_a_third_party_robust_rule_is_found_through_its_entry_point(fake_distribution):
    assert "clipped_mean" in RobustRule.registry.names()          # listed before it is imported
    cls = get_robust_rule("clipped_mean")
    assert cls.__module__ == "fedmoe_fake_rule" and cls.name == "clipped_mean"
    # the config accepts it and its params (checked by the rule), in the existing format
    cfg = DefenceConfig(robust={"name": "clipped_mean", "params": {"bound": 0.5}})
    with pytest.raises(ValidationError, match="unknown parameters.*'bound'"):
        DefenceConfig(robust={"name": "clipped_mean", "params": {"trim": 0.1}})
    # ... and the wrapper applies it like a built-in rule
    agg = RobustAggregation(Modular(), cfg.robust.name, **cfg.robust.params)
    gs = {"backbone.l0.lora_A": torch.zeros(2)}
    rs = [ClientResult(d, "t", 10, {}, {"backbone.l0.lora_A": torch.full((2,), v)}, None)
          for d, v in (("a", 0.1), ("b", 0.2), ("c", 90.0))]
    out = agg.aggregate(1, gs, rs, [])
    torch.testing.assert_close(out["backbone.l0.lora_A"], torch.full((2,), (0.1 + 0.2 + 0.5) / 3))
    assert agg.label == "modular+clipped_mean" and agg.report["robust_units"] == 1


def test_a_third_party_objective_term_module_registers_what_it_defines(fake_distribution):
    check_objectives([Objective(name="fake_zero")])
    (term,) = terms_for(TrainConfig(), [Objective(name="fake_zero")], {})
    assert type(term).__module__ == "fedmoe_fake_terms" and float(term(None, {}, torch.ones(2, 3))) == 0.0


def test_an_entry_point_of_the_wrong_kind_is_refused(fake_distribution):
    with pytest.raises(TypeError, match="not_a_rule.*is not a RobustRule"):
        get_robust_rule("not_a_rule")


@pytest.mark.parametrize("lookup,typo,suggested", [
    (get_strategy, "fusion_hybird", "fusion_hybrid"),
    (get_assignment, "flexx", "flex"),
    (get_assignment, "random_mo", "random_kept"),            # via its alias random_moe
    (get_aggregation, "usage-weighted", "usage_weighted"),
    (get_robust_rule, "krum", "multi_krum"),                  # a part of the name
    (get_adapter, "conv", "conv-moe"),
    (ObjectiveTerm.lookup, "fedprx", "fedprox"),
])
def test_an_unknown_name_suggests_a_near_miss_and_lists_the_known_names(lookup, typo, suggested):
    with pytest.raises(UnknownNameError, match=f"did you mean '{suggested}'") as e:
        lookup(typo)
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)
    assert "; known: " in str(e.value) and "entry-point group 'fedmoe." in str(e.value)


def test_unknown_names_in_configs_are_validation_errors():
    with pytest.raises(ValidationError, match="unknown robust aggregation rule 'krum' .*did you mean 'multi_krum'"):
        DefenceConfig(robust={"name": "krum"})
    with pytest.raises(ValueError, match="unknown objective term 'nope'; known: .*fedprox"):
        check_objectives([Objective(name="nope")])
    assert DefenceConfig(robust={"name": "none"}).robust.name == "none"


def test_a_taken_name_is_refused_and_a_subclass_does_not_inherit_its_parents_name(monkeypatch):
    monkeypatch.setattr(RobustRule.registry, "_classes", dict(RobustRule.registry._classes))
    median = get_robust_rule("median")

    class Unnamed(median):  # no name of its own: not registered, the parent keeps its name
        pass

    assert get_robust_rule("median") is median
    with pytest.raises(ValueError, match="'median' is taken by cloud.robust.rules.median.Median"):
        class Impostor(RobustRule):
            name = "median"


def test_a_model_family_registers_by_name_not_family():
    with pytest.raises(TypeError, match="registers by `name = 'x'`"):
        class Old(ModelAdapter):
            family = "x"


def test_a_look_up_imports_only_the_module_named_for_it():
    """A device building one family must not import the others (nor their dependencies):
    the registry tries the module named for the family before scanning the package."""
    import subprocess

    code = ("import sys; from moe_model.models import get_adapter; get_adapter('conv-moe'); "
            "print(sorted(m for m in sys.modules if m.startswith('moe_model.models.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout.strip().splitlines()[-1]
    assert "moe_model.models.conv_moe" in loaded
    assert "hf_moe" not in loaded and "upcycle_hf" not in loaded and "bert_upcycled" not in loaded, loaded
