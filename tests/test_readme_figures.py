"""README figures come from the committed result files: the end-to-end table is regenerated from
`benchmarks/results/end_to_end.json` and must appear in the README verbatim."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _end_to_end_module():
    spec = importlib.util.spec_from_file_location("end_to_end", os.path.join(ROOT, "benchmarks", "end_to_end.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_end_to_end_table_matches_the_results():
    rows = json.load(open(os.path.join(ROOT, "benchmarks", "results", "end_to_end.json")))["rows"]
    table = _end_to_end_module().readme_table(rows)
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert table in readme, "README's end-to-end table is stale: regenerate it with benchmarks/end_to_end.py --readme"


def test_dispatch_table_is_the_one_the_package_ships():
    # the package's table was written from the committed sweep (benchmarks/attention_dispatch.py --write-table)
    shipped = json.load(open(os.path.join(ROOT, "hf_fastpath", "attention", "dispatch_sm90.json")))
    sweep = json.load(open(os.path.join(ROOT, shipped["meta"]["source"])))
    assert shipped["meta"]["date"] == sweep["meta"]["date"] and shipped["meta"]["gpu"] == sweep["meta"]["gpu"]
    decode = {(r["head_dim"], r["heads"] > r["kv_heads"], r["batch"], r["kv_len"]): r["ms"]
              for r in sweep["rows"] if r["phase"] == "decode"}
    for row in shipped["rows"]:
        if row["phase"] == "decode":
            ms = decode[(row["head_dim"], row["gqa"], row["batch"], row["kv_len"])]
            assert (row["triton_ms"], row["sdpa_ms"]) == (round(ms["ours"], 5), round(ms["sdpa"], 5))
