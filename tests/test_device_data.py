"""``fedmoe data split``: per-device files, the held-out test split kept apart (for a
built-in set exactly the aggregator's ``builtin:NAME`` test data), the manifest, and
one-line errors for bad input."""

import json

import pytest

from fedmoe.cli import main
from fedmoe.device_data import split_devices
from fedmoe.simulate import builtin_test_set, split_task


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_builtin_split_keeps_the_aggregators_test_split_out_of_every_device(tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["data", "split", "--from", "builtin:bbc", "--count", "6", "--prefix", "dev-", "--partition",
                 "dirichlet:0.5", "--seed", "3", "--out", str(out)]) == 0
    assert "eval_data: builtin:bbc" in capsys.readouterr().out
    test_items, labels = builtin_test_set("bbc")
    test = _read(out / "test.jsonl")
    assert sorted((t["text"], t["label"]) for t in test) == sorted(test_items)  # the aggregator's, exactly
    test_texts = {x for x, _ in test_items}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == "builtin:bbc" and manifest["method"] == "dirichlet:0.5" and manifest["seed"] == 3
    assert manifest["test"]["eval_data"] == "builtin:bbc" and manifest["test"]["samples"] == len(test_items)
    assert list(manifest["devices"]) == [f"dev-{i}" for i in range(6)]
    seen = []
    for device_id, info in manifest["devices"].items():
        rows = _read(out / info["file"])
        assert len(rows) == info["samples"] > 0
        assert info["per_label"] == {y: sum(r["label"] == y for r in rows) for y in labels}
        assert not {r["text"] for r in rows} & test_texts  # no test sample in any device file
        seen += [r["text"] for r in rows]
    items, _, train_idx, _ = split_task("bbc", dedup=False)  # the split as drawn, before the duplicates go
    train = [items[i][0] for i in train_idx]
    assert manifest["dropped"] == sum(x in test_texts for x in train) > 0  # the set repeats some texts
    assert sorted(seen) == sorted(x for x in train if x not in test_texts)  # every other training sample, once
    sizes = [i["samples"] for i in manifest["devices"].values()]
    assert max(sizes) > 1.5 * min(sizes)  # Dirichlet(0.5): skewed, not an equal split


@pytest.mark.parametrize("task, seed, max_samples", [("bbc", 0, None), ("tweets", 0, None), ("bbc", 3, 800)])
def test_the_simulators_split_trains_on_no_text_of_its_test_split(task, seed, max_samples, caplog):
    """``fedmoe simulate``'s split (and every benchmark built on it, ``cells.load_data``):
    BBC News repeats 33 texts and the tweets 602; none that is in the test split stays in
    the training part, and the log says how many went."""
    import logging

    caplog.set_level(logging.INFO, logger="fedmoe.sim_data")
    items, labels, train_idx, test_idx = split_task(task, seed, 0.2, max_samples)
    test_texts = {items[i][0] for i in test_idx}
    assert not {items[i][0] for i in train_idx} & test_texts
    raw = split_task(task, seed, 0.2, max_samples, dedup=False)
    assert raw[0] == items and raw[3] == test_idx  # the same items and test split as before
    dropped = [i for i in raw[2] if items[i][0] in test_texts]
    assert dropped and train_idx == [i for i in raw[2] if i not in set(dropped)]  # only those went, order kept
    assert f"{task}: {len(dropped)} of {len(raw[2])} training items dropped" in caplog.text
    assert split_task(task, seed, 0.2, max_samples) == (items, labels, train_idx, test_idx)  # deterministic
    if max_samples is None:  # what `eval_data: builtin:TASK` evaluates on is this test split, unchanged
        assert builtin_test_set(task, seed)[0] == [items[i] for i in test_idx]


def test_split_is_deterministic_per_seed_and_shrinks_cleanly(tmp_path):
    src = tmp_path / "mine.csv"
    src.write_text("text,label\n" + "".join(f"sample {i},{'abc'[i % 3]}\n" for i in range(90)))
    a = split_devices(str(src), ["d0", "d1", "d2"], tmp_path / "a", "classes:2", seed=1)
    b = split_devices(str(src), ["d0", "d1", "d2"], tmp_path / "b", "classes:2", seed=1)
    c = split_devices(str(src), ["d0", "d1", "d2"], tmp_path / "c", "classes:2", seed=2)
    for f in ("d0.jsonl", "d1.jsonl", "d2.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert a["devices"] == b["devices"] and a["devices"] != c["devices"]
    assert a["test"]["samples"] == 18 and sum(d["samples"] for d in a["devices"].values()) == 72
    assert all(sum(n > 0 for n in d["per_label"].values()) <= 2 for d in a["devices"].values())  # classes:2
    test_texts = {r["text"] for r in _read(tmp_path / "a" / "test.jsonl")}
    assert not any(test_texts & {r["text"] for r in _read(tmp_path / "a" / f"d{i}.jsonl")} for i in range(3))
    split_devices(str(src), ["d0"], tmp_path / "a", "iid", seed=1)  # fewer devices: no stale files left
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["d0.jsonl", "manifest.json", "test.jsonl"]


@pytest.mark.parametrize("content,args,message", [
    ("words,label\nhi,a\n", [], "text and label"),                       # a missing column
    ("", [], "no samples"),                                             # an empty file
    ("text,label\n" + "x,a\n" * 20, ["--partition", "dirichlet:0"], "ALPHA > 0"),
    ("text,label\n" + "".join(f"s{i},a\n" for i in range(5)), ["--count", "9"], "9 devices but only 4 training"),
    ("text,label\nx,a\n", ["--test-fraction", "1"], "[0, 1)"),
])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, content, args, message):
    src = tmp_path / "in.csv"
    src.write_text(content)
    argv = ["data", "split", "--from", str(src), "--out", str(tmp_path / "o"), *args]
    if "--count" not in args:
        argv += ["--count", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("fedmoe: error:") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o" / "manifest.json").exists()


def test_missing_file_and_no_devices(tmp_path, capsys):
    assert main(["data", "split", "--from", str(tmp_path / "nope.jsonl"), "--count", "2", "--out", str(tmp_path)]) == 2
    assert main(["data", "split", "--from", "builtin:bbc", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nope.jsonl" in err and "no devices" in err
