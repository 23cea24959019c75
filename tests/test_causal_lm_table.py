"""The harness's causal-LM table (benchmarks/causal_lm_table.py): its data from a BTX build's
domains and split, its config checks and its own-domain count."""

import json

import pytest

from benchmarks import causal_lm_table as T
from benchmarks import harness
from fedmoe.btx_domains import _chunks, domain_items, load_domains

DOMAINS = ["bbc-sports", "bbc-tech"]


@pytest.fixture(scope="module")
def btx_dir(tmp_path_factory):
    """A directory with the ``btx.json`` a build over two BBC categories records (no weights)."""
    d = tmp_path_factory.mktemp("btx")
    _, held, record = load_domains(DOMAINS, seed=0)
    (d / "btx.json").write_text(json.dumps({"domains": DOMAINS, **record}))
    return d, held


def test_items_come_from_the_builds_split_balanced_and_seeded(btx_dir):
    d, held = btx_dir
    train, test, labels = domain_items(d, 3, samples=40, eval_samples=10, chunk_chars=300)
    assert labels == DOMAINS
    assert [y for _, y in train].count("bbc-tech") == 20 and [y for _, y in test].count("bbc-sports") == 5
    assert all(len(t) <= 300 for t, _ in train + test)
    held_text = {name: "".join(texts) for name, texts in held.items()}
    assert all(t in held_text[y] for t, y in test)  # every test piece is a held-out document's
    assert not any(t in held_text[y] for t, y in train if len(t) > 100)  # no training piece is
    assert domain_items(d, 3, 40, 10, 300) == (train, test, labels)
    assert domain_items(d, 4, 40, 10, 300)[0] != train


def test_items_refuse_a_directory_that_is_not_a_btx_build_or_whose_split_changed(btx_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="fedmoe upcycle --method btx"):
        domain_items(tmp_path, 0, 10, 10)
    record = json.loads((btx_dir[0] / "btx.json").read_text())
    record["heldout_ids"]["bbc-tech"][0] = "not-an-id"
    (tmp_path / "btx.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="differs"):
        domain_items(tmp_path, 0, 10, 10)


def test_chunks_cap_pieces_per_document_and_drop_short_tails():
    assert _chunks("a" * 1000, 300, 2) == ["a" * 300] * 2
    assert _chunks("a" * 700, 300, 5) == ["a" * 300] * 2  # the 100-character tail is dropped
    assert _chunks("short", 300, 4) == ["short"]


def test_config_checks_name_the_problem(tmp_path):
    cfg = harness.load_config("benchmarks/configs/fedmoe_btx_llm.yaml")
    assert harness.table_of(cfg) is T and list(harness.settings(cfg)) == ["domains 1-domain 5"]
    bad = tmp_path / "bad.yaml"
    text = open("benchmarks/configs/fedmoe_btx_llm.yaml").read()
    bad.write_text(text.replace("objective: causal-lm, ", "").replace("  devices: [5]", "  devices: [7]\n  data: [bbc]"))
    with pytest.raises(harness.ConfigError, match="this table's one data source is 'domains'.*"
                                                  "objective must be causal-lm"):
        harness.load_config(bad)


def _report(held: dict[str, list[dict]]) -> dict:
    return {"config": {"aggregator": {"tasks": {"domains": {"labels": ["a", "b", "c", "d"]}},
                                      "model": {"num_experts": 4}},
                       "devices": [{"device_id": "d0", "labels": {"a": 5}}, {"device_id": "d1", "labels": {"c": 3}}]},
            "rounds": [{"devices": {dev: {"experts": rounds[i]} for dev, rounds in held.items()}}
                       for i in range(len(next(iter(held.values()))))]}


def test_own_domain_slots_count_small_devices_from_round_two():
    report = _report({"d0": [{"0": [1, 2]}, {"0": [0, 1], "1": [0, 3]}, {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3]}],
                      "d1": [{"0": [2]}, {"0": [2, 3], "1": [1, 3]}, {"0": [2], "1": [2]}]})
    # round 1 ignored; d0 round 3 holds every expert (not counted); own: d0 -> 0, d1 -> 2
    assert T.own_domain_slots(report) == (2 + 1 + 2, 4 + 4 + 2)
