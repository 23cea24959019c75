"""The peer comparison's table (benchmarks/peer.py) from synthetic runs: per-run summaries, the
learning-rate sweep's table, per-domain perplexity and the Holm-corrected paired tests."""

from benchmarks import peer

MiB = 2**20


def _run(ppl: list[float], devices: list[str], lr: float, per_label: dict | None = None) -> dict:
    rows = [{"round": r, "device": d, "bytes": 10 * MiB, "peak": 900 * MiB, "budget": 1000 * MiB, "experts": 20}
            for r in (1, 2) for d in devices]
    return {"perplexity": ppl, "round_seconds": [30.0, 31.0], "rows": rows, "lr": lr,
            "per_label_perplexity": per_label or {}}


def _result() -> dict:
    runs = {}
    for s, shift in ((0, 0.0), (1, 0.4), (2, -0.3)):
        ours = _run([40.0, 38.0, 36.0 + shift], ["d0", "d1", "d2"], 1e-3, {"tweets": 50.0 + shift, "python": 9.0})
        theirs = _run([40.0, 39.0, 38.5 + shift + 0.1 * s], ["d0"], 3e-4, {"tweets": 55.0, "python": 10.0})
        runs[str(s)] = {"ours fedmoe (own_p=true)": ours, "peer nf4+gc": theirs}
        for r in runs[str(s)].values():
            r["summary"] = peer.summarise(r, 3)
    result = {"profile": "full", "seeds": [0, 1, 2], "rounds": 2, "budgets": [3.0, 0.8, 0.7], "partition": "classes:1",
              "steps": 4, "batch_size": 4, "seq_len": 96, "lr": 1e-2, "lr_sweep": [3e-4, 1e-3, 3e-3],
              "sweep": {"ours fedmoe (own_p=true)": {"0.0003": 37.0, "0.001": 36.0, "0.003": 36.5},
                        "peer nf4+gc": {"0.0003": 38.5, "0.001": 39.0, "0.003": None}},
              "lr_of": {"ours fedmoe (own_p=true)": 1e-3, "peer nf4+gc": 3e-4}, "task": "domains", "rank": 8,
              "update_precision": "nf4", "state_precision": "int8", "compression": True,
              "checkpoint": {"params": 300e6, "expert_share": 0.6, "safetensors_bytes": 600 * MiB},
              "checkpoint_dir": "runs/btx-smollm2-l20", "probe_peaks": {"nf4+gc": 1800 * MiB},
              "ours": ["ours fedmoe (own_p=true)"], "variants": ["peer nf4+gc"],
              "methods": ["ours fedmoe (own_p=true)", "peer nf4+gc"], "runs": runs}
    result["table"] = peer.table(result)
    return result


def test_summaries_count_devices_bytes_and_the_final_perplexity():
    s = _result()["runs"]["1"]["ours fedmoe (own_p=true)"]["summary"]
    assert s["final_perplexity"] == 36.4 and s["devices"] == 3 and s["device_rounds"] == 6
    assert s["mib_round1"] == 10.0 and s["worst_peak_over_budget"] == 0.9 and s["over_budget"] == 0


def test_the_table_gives_the_sweep_the_domains_and_holm_corrected_pairs():
    result = _result()
    pair = result["table"]["pairs"]["ours fedmoe (own_p=true) vs peer nf4+gc"]
    assert pair["n"] == 3 and pair["diff"] < 0 and pair["p_holm"] == pair["p"]  # a family of one
    md = peer.markdown(result)
    assert "`runs/btx-smollm2-l20`" in md and "the BTX checkpoint's text domains classes:1" in md
    assert "the best of 0.0003, 0.001, 0.003 on seed 0" in md
    assert "| ours fedmoe (own_p=true) | 37.00 | **36.00** | 36.50 |" in md
    assert "| peer nf4+gc | **38.50** | 39.00 | – |" in md
    assert "| method | python | tweets |" in md and "| peer nf4+gc | 10.00 | 55.00 |" in md
    assert "p_Holm = " in md and ("**ours better**" in md) == (pair["p_holm"] < 0.05)


def test_the_peers_evaluation_by_label_is_the_token_weighted_whole(tmp_path):
    """One evaluation per label; the whole equals one evaluation of every text (how the
    cloud's ``per_label`` works too)."""
    import math

    import pytest
    from transformers import AutoModelForCausalLM

    from benchmarks.peer_client import loss_sums, perplexity_by_label
    from tests.test_hf_moe import _mixtral_checkpoint, _tokenizer

    model = AutoModelForCausalLM.from_pretrained(_mixtral_checkpoint(tmp_path / "ckpt"))
    tok = _tokenizer()
    items = [("the bank rate market growth shares", "x"), ("film music award", "y"), ("a team match goal", "y"),
             ("vote minister the bank", "x")]
    whole, per_label = perplexity_by_label(model, tok, items, 16)
    loss, n = loss_sums(model, tok, [x for x, _ in items], 16)
    assert whole == pytest.approx(math.exp(loss / n), rel=1e-5)
    x_loss, x_n = loss_sums(model, tok, [x for x, y in items if y == "x"], 16)
    assert set(per_label) == {"x", "y"} and per_label["x"] == pytest.approx(math.exp(x_loss / x_n), rel=1e-5)
    assert perplexity_by_label(model, tok, items[:1], 16)[1] == {}
